"""The command-line reference (``docs/reference/cli.md``), from the argparse parsers.

:func:`alpajob.cli.main.parser` builds the whole ``alpajob`` command line; this page
walks it, one section per command (nested commands such as ``alpajob data prepare``
included), with its usage line as ``--help`` prints it and a row per argument: its
flags, what it takes, its default, its choices, and its help text. argparse has no
public way to list a parser's arguments, so the walk reads ``_actions``, the list every
parser keeps and ``--help`` itself formats.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from alpajob.cli.main import parser
from alpajob.reference.markdown import cell, code, page, table


def _commands(command: argparse.ArgumentParser, name: str,
              summary: str) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(full name, one-line summary, parser) of ``command`` and every command under it."""
    yield name, summary, command
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for child, sub in action.choices.items():
                yield from _commands(sub, f"{name} {child}", helps.get(child, ""))


def _takes(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "flag"
    value = action.metavar or action.dest.upper()
    if action.nargs in ("*", "+"):
        return f"{value} ..."
    return str(value)


def _help(action: argparse.Action, prog: str) -> str:
    """The help text with argparse's ``%(default)s``-style fields filled in."""
    text = action.help or ""
    if "%" in text:
        text = argparse.HelpFormatter(prog)._expand_help(action)
    return text


def _row(action: argparse.Action, prog: str) -> list[str]:
    name = ", ".join(code(f) for f in action.option_strings) or code(action.dest)
    if action.required and action.option_strings:
        name += " (required)"
    default = action.default
    shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else code(default)
    choices = ", ".join(code(c) for c in action.choices) if action.choices else ""
    takes = _takes(action)
    return [name, takes if takes == "flag" else code(takes), shown, choices, cell(_help(action, prog))]


def _anchor(name: str) -> str:
    return name.replace(" ", "-")


def _section(name: str, summary: str, command: argparse.ArgumentParser) -> list[str]:
    usage = " ".join(command.format_usage().removeprefix("usage: ").split())
    lines = [f"## {name} {{#{_anchor(name)}}}", ""]
    if summary:
        lines += [cell(summary[0].upper() + summary[1:]) + ("" if summary.endswith(".") else "."), ""]
    if command.description and command.description != summary:
        lines += [cell(command.description), ""]
    lines += ["```text", usage, "```", ""]
    arguments = [a for a in command._actions
                 if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
                 and a.help != argparse.SUPPRESS]
    if arguments:
        lines += table(["Argument", "Takes", "Default", "Choices", "Description"],
                       [_row(a, command.prog) for a in arguments]) + [""]
    children = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
    if children:
        lines += ["Commands: " + ", ".join(f"[`{name} {c}`](#{_anchor(f'{name} {c}')})"
                                          for a in children for c in a.choices), ""]
    return lines


def render() -> str:
    """The whole page."""
    root = parser()
    body: list[str] = []
    for name, summary, command in _commands(root, "alpajob", ""):
        body += _section(name, summary, command)
    intro = ("Every `alpajob` command and flag, as `alpajob COMMAND --help` prints them "
             "(this page is generated from the same parsers). A bad flag or manifest prints one "
             "line naming it and the fix and exits with status 2; see the "
             "[troubleshooting guide](../guides/troubleshooting.md).")
    return page("Command-line reference", intro, body)
