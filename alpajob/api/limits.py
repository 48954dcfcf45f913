"""The sane range of every count a user gives: the most AlpaJob takes, and why.

A count above its format's maximum is refused by the API server; a count far below
that can still make no sense (a pool of a million nodes, a trillion micro-batches) and
would only show up as a planner that runs for hours or a step predicted to take years.
Each :class:`Limit` here is the one home of such a bound: the typed spec puts it in the
CRD's schema (``maximum``), so ``kubectl apply`` refuses it at once, and the messages
of the typed model, the CLI's flags and the zoo's config keys give its reason::

    spec.cluster.nodes: 1000000 is above 1,024, the most AlpaJob takes: ...

The bounds are generous: each is at least 8 times what the largest published training
run of its kind used, and low enough that the planner's work stays bounded (its
search grows with nodes, layers and micro-batch counts).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import AfterValidator, Field


class Limit(NamedTuple):
    """The largest value a count may take, and why.

    A typed field takes it as ``Annotated[int, NODES.validator, NODES.schema]``: the
    validator refuses a larger value with :meth:`message`, the schema puts ``maximum``
    into the CRD.
    """

    most: int
    why: str

    def message(self, value: object) -> str:
        """What the user reads for a ``value`` above the limit."""
        return f"{value} is above {self.most:,}, the most AlpaJob takes: {self.why}"

    @property
    def validator(self) -> AfterValidator:
        def check(value: Any) -> Any:
            if isinstance(value, int) and value > self.most:
                raise ValueError(self.message(value))
            return value

        return AfterValidator(check)

    @property
    def schema(self) -> Any:
        return Field(json_schema_extra={"maximum": self.most})


NODES = Limit(1024, "the planner's submesh search grows with the pool; 1,024 nodes (8,192 "
                    "GPUs at 8 a node) is 128 times the Alpa paper's largest pool; split a "
                    "larger pool into several jobs")
GPUS_PER_NODE = Limit(16, "no GPU server has more than 16 GPUs; submeshes tile a node, so its "
                          "count must also be a power of two (1, 2, 4, 8, 16)")
LOCAL_DEVICES = Limit(256, "XLA makes every forced CPU device when it starts (4,096 took 18 s "
                           "on 2 cores, 100,000 did not start in 2 minutes) and the devices share "
                           "this machine's cores; plan a real pool with spec.cluster instead")
GLOBAL_BATCH_SIZE = Limit(2**24, "16,777,216 samples a step is 10,000 times GPT-3's batch "
                                 "(1,536 sequences of 2,048 tokens)")
MICRO_BATCHES = Limit(16384, "the pipeline's schedule lists every micro-batch's forward and "
                             "backward per stage; past 16,384 the schedule alone outweighs the step")
STEPS = Limit(10**9, "a billion steps is 31 years at one step a second")
EVAL_STEPS = Limit(10**6, "each evaluation averages this many batches; a million batches is "
                          "an evaluation longer than most training runs")
LAYERS = Limit(256, "the planner traces and clusters every layer, about a second each on 2 "
                    "cores (GPT-tiny: 76 s for 64 layers, 139 s for 128); 256 is 2.7 times "
                    "GPT-3's 96 layers")
WIDTH = Limit(65536, "the widest published transformers are 25,600 wide (PaLM: 18,432); "
                     "a wider layer does not fit any GPU")
HEADS = Limit(1024, "attention heads; 1,024 is 8 times the most of any published model")
SEQ_LEN = Limit(2**18, "attention is quadratic in the sequence; 262,144 tokens is 128 "
                       "times GPT-3's context")
VOCAB = Limit(2**22, "4,194,304 tokens is 16 times the largest published vocabularies")
EXPERTS = Limit(4096, "experts per MoE layer; 4,096 is twice the most of any published model")
GROUP_SIZE = Limit(2**20, "tokens routed together; the dispatch tensor grows with its square")
CAPACITY_FACTOR = Limit(64, "slots per expert as a multiple of its fair share; above the "
                            "expert count it only pads")
CHANNELS = Limit(16384, "the base width of a Wide-ResNet; 16,384 is 50 times the Alpa "
                        "paper's widest (320)")
WIDTH_FACTOR = Limit(64, "the bottleneck's widening; 64 is 4 times the Alpa paper's widest (16)")
IMAGE_SIZE = Limit(4096, "a 4,096 x 4,096 image is 300 times the pixels of ImageNet's")
CLASSES = Limit(10**6, "a million classes is a thousand times ImageNet's")
FEATURES = Limit(2**20, "the widest input or output an MLP layer of the zoo takes")
GLOB_FILES = Limit(100_000, "a pattern of spec.data is listed before training starts; past "
                            "100,000 files it is walking far more than a corpus (a pattern such "
                            "as /**/* walks the whole filesystem)")
