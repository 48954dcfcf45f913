"""Authentication and RBAC authorization, as kube-apiserver does them, for the test API
server (:mod:`kube_emulator`).

**Who asks.** A request's ``Authorization: Bearer <token>`` names its user: the
administrator's token (the tests' own clients, the test kubelet: ``system:masters``,
allowed everything, as a cluster admin's kubeconfig is), or a token that the server
issued for a ServiceAccount through the TokenRequest API
(``POST .../serviceaccounts/<name>/token``, what a kubelet asks for each pod, and what
the tests ask for the operator's identity). A ServiceAccount's user is
``system:serviceaccount:<namespace>:<name>``, in the groups ``system:serviceaccounts``,
``system:serviceaccounts:<namespace>`` and ``system:authenticated``. A request without
a token, or with one the server never issued, is answered 401.

**What it may do.** Every request to a resource is turned into the verb RBAC knows
(``get``, ``list``, ``watch``, ``create``, ``update``, ``patch``, ``delete``,
``deletecollection``) and allowed only when a rule grants it: the rules of every
ClusterRole bound to the user by a ClusterRoleBinding (anywhere), and of every Role
or ClusterRole bound by a RoleBinding in the request's namespace (there only). A rule
matches on API group, resource (``pods``, or ``pods/status`` for a subresource),
verb and, when it lists ``resourceNames``, the object's name: so a ``create``, which
names no object in its URL, is never granted by a rule with ``resourceNames``, as on
a real server. The roles and bindings are the objects stored in the server (the
shipped manifests, applied through the API), read on every request. Discovery and
other non-resource paths are open to every authenticated user (what
``system:discovery`` grants). A refusal is kube-apiserver's 403 and its message.

**No escalation.** As kube-apiserver's RBAC storage does, a user may create or
update a Role or ClusterRole only with permissions it holds itself where the role
applies (or with the ``escalate`` verb on it), and a RoleBinding or
ClusterRoleBinding only to a role whose every permission it holds where the binding
applies (or with the ``bind`` verb on that role): an operator that hands out a Role
must hold what the Role grants (:func:`escalation`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: The administrator's token: the kubeconfig the tests write (``Emulator.kubeconfig``).
ADMIN_TOKEN = "test"
ADMIN = "kubernetes-admin"
RBAC_GROUP = "rbac.authorization.k8s.io"


@dataclass(frozen=True)
class User:
    """An authenticated user: its name and groups."""

    name: str
    groups: tuple[str, ...]

    @property
    def admin(self) -> bool:
        return "system:masters" in self.groups

    @staticmethod
    def service_account(namespace: str, name: str) -> User:
        return User(f"system:serviceaccount:{namespace}:{name}",
                    ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"))


@dataclass(frozen=True)
class Ask:
    """What a request asks, in RBAC's terms."""

    verb: str
    group: str
    resource: str  # the plural, with ``/subresource``
    namespace: str | None
    name: str | None


def verb_of(method: str, name: str | None, params: Mapping[str, str]) -> str:
    """The RBAC verb of an HTTP request to a resource."""
    method = method.upper()
    if method == "GET":
        if name is not None:
            return "get"
        return "watch" if str(params.get("watch", "")).lower() in ("true", "1") else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(
        method, "delete" if name is not None else "deletecollection")


class Tokens:
    """The tokens this server issued, and the user each one stands for."""

    def __init__(self) -> None:
        self._users: dict[str, User] = {ADMIN_TOKEN: User(ADMIN, ("system:masters", "system:authenticated"))}

    def issue(self, namespace: str, account: str) -> str:
        token = secrets.token_urlsafe(24)
        self._users[token] = User.service_account(namespace, account)
        return token

    def user(self, headers: Mapping[str, str]) -> User | None:
        header = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        kind, _, token = header.partition(" ")
        return self._users.get(token.strip()) if kind.lower() == "bearer" else None


def _subject_matches(subject: Mapping[str, Any], user: User) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "ServiceAccount":
        return user.name == f"system:serviceaccount:{subject.get('namespace')}:{name}"
    if kind == "User":
        return user.name == name
    if kind == "Group":
        return name in user.groups
    return False


def _rule_matches(rule: Mapping[str, Any], ask: Ask) -> bool:
    groups, resources, verbs = rule.get("apiGroups") or [], rule.get("resources") or [], rule.get("verbs") or []
    names = rule.get("resourceNames") or []
    plural, _, sub = ask.resource.partition("/")
    return ((ask.group in groups or "*" in groups)
            and (ask.resource in resources or "*" in resources or (sub and f"*/{sub}" in resources))
            and (ask.verb in verbs or "*" in verbs)
            and (not names or (ask.name is not None and ask.name in names)))


def allowed(user: User, ask: Ask, objects: Callable[[str], Iterable[Mapping[str, Any]]]) -> bool:
    """Whether ``user`` may do ``ask``; ``objects(plural)`` gives the stored objects of
    one kind of ``rbac.authorization.k8s.io`` (``clusterroles``, ``roles``, ...)."""
    if user.admin:
        return True
    cluster_roles = {r["metadata"]["name"]: r for r in objects("clusterroles")}
    roles = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in objects("roles")}
    granted: list[Mapping[str, Any]] = []
    for binding in objects("clusterrolebindings"):
        if any(_subject_matches(s, user) for s in binding.get("subjects") or []):
            granted.append(cluster_roles.get(binding["roleRef"]["name"]) or {})
    if ask.namespace is not None:
        for binding in objects("rolebindings"):
            if binding["metadata"].get("namespace") != ask.namespace:
                continue
            if not any(_subject_matches(s, user) for s in binding.get("subjects") or []):
                continue
            ref = binding["roleRef"]
            role = cluster_roles.get(ref["name"]) if ref.get("kind") == "ClusterRole" else \
                roles.get((ask.namespace, ref["name"]))
            granted.append(role or {})
    return any(_rule_matches(rule, ask) for role in granted for rule in role.get("rules") or [])


def forbidden_message(user: User, ask: Ask) -> str:
    """kube-apiserver's message for a request RBAC refuses."""
    what = f'{ask.resource} "{ask.name}"' if ask.name else ask.resource
    where = f'in the namespace "{ask.namespace}"' if ask.namespace else "at the cluster scope"
    return (f'{what} is forbidden: User "{user.name}" cannot {ask.verb} resource "{ask.resource}" '
            f'in API group "{ask.group}" {where}')


#: The RBAC kinds whose writes are checked for escalation, by plural.
ROLES = ("roles", "clusterroles")
BINDINGS = ("rolebindings", "clusterrolebindings")


def _asks(rules: Iterable[Mapping[str, Any]], namespace: str | None) -> Iterable[tuple[Mapping[str, Any], Ask]]:
    """Each permission of ``rules`` as the request it allows (a ``*`` stays a literal
    ``*``: only a ``*`` held covers it, as kube-apiserver's coverage check says)."""
    for rule in rules:
        for group in rule.get("apiGroups") or []:
            for resource in rule.get("resources") or []:
                for verb in rule.get("verbs") or []:
                    for name in rule.get("resourceNames") or [None]:
                        yield rule, Ask(verb, group, resource, namespace, name)


def escalation(user: User, ask: Ask, body: Mapping[str, Any],
               objects: Callable[[str], Iterable[Mapping[str, Any]]]) -> str | None:
    """kube-apiserver's refusal of a role or binding write ``ask`` (``body``, the
    object) that grants what ``user`` does not hold, or None when it grants nothing
    more (or the user may ``escalate`` / ``bind``)."""
    plural = ask.resource.partition("/")[0]
    if user.admin or ask.verb not in ("create", "update") or ask.group != RBAC_GROUP \
            or plural not in ROLES + BINDINGS:
        return None
    name = ask.name or (body.get("metadata") or {}).get("name")
    namespace = ask.namespace if plural in ("roles", "rolebindings") else None
    if plural in ROLES:
        if allowed(user, Ask("escalate", RBAC_GROUP, plural, namespace, name), objects):
            return None
        rules = body.get("rules") or []
    else:
        ref = body.get("roleRef") or {}
        role_plural = "clusterroles" if ref.get("kind") == "ClusterRole" else "roles"
        if allowed(user, Ask("bind", RBAC_GROUP, role_plural, namespace if role_plural == "roles" else None,
                             ref.get("name")), objects):
            return None
        if role_plural == "clusterroles":
            role = next((r for r in objects("clusterroles") if r["metadata"]["name"] == ref.get("name")), None)
        else:
            role = next((r for r in objects("roles") if r["metadata"]["name"] == ref.get("name")
                         and r["metadata"].get("namespace") == namespace), None)
        if role is None:
            return f'{plural}.{RBAC_GROUP} "{name}" is forbidden: {ref.get("kind")} "{ref.get("name")}" not found'
        rules = role.get("rules") or []
    missing = [rule for rule, wanted in _asks(rules, namespace) if not allowed(user, wanted, objects)]
    if not missing:
        return None
    shown = "\n".join(f"{{APIGroups:{r.get('apiGroups')}, Resources:{r.get('resources')}, "
                      f"ResourceNames:{r.get('resourceNames') or []}, Verbs:{r.get('verbs')}}}"
                      for r in {id(r): r for r in missing}.values())
    return (f'{plural}.{RBAC_GROUP} "{name}" is forbidden: user "{user.name}" (groups={list(user.groups)}) '
            f"is attempting to grant RBAC permissions not currently held:\n{shown}")

