"""Pins: the decisions a user fixes, which the planner then finishes around (``--pin``).

A pin is written ``PATTERN=VALUE``:

- ``h.*.mlp.c_fc.weight=[R, S(0)]``: a placement, written as plan.json writes it (one entry
  per mesh axis; ``*`` leaves that axis to the planner). PATTERN names parameters (by FQN),
  user inputs or graph nodes (by node name);
- ``*.weight=fsdp``: the matched parameters are stored sharded over every mesh axis, gathered
  where an op reads them whole (FSDP / ZeRO-3);
- ``lm_head.weight=zero2``: the matched parameters are stored whole, their reduced gradients
  and optimizer states sharded, the updated shards gathered once per step (ZeRO-2);
- ``h.0-3=stage:0``: the layers holding the matched modules' ops lie in pipeline stage 0;
- ``h.*=checkpoint``: the layers holding the matched modules' ops are recomputed in the
  backward (activation checkpointing);
- ``mesh=2x4``, ``tp=8``, ``stages=2``, ``microbatches=32``: the plan's structure. ``tp=N``
  asks for a mesh whose last axis has ``N`` devices, over which every weight matrix that ``N``
  divides is used in place (Megatron tensor parallelism, the rule of ``--manual tp=``);
- ``--manual``'s words as pins: ``dp=N``, ``fsdp=N`` (with ``tp=``, the mesh of each stage is
  their degrees above 1 in that order, and the rule of
  :func:`~autoplan.planner.manual.manual_rule` holds on it), ``zero=1|2`` (over ``dp``),
  ``pp=N`` (``stages=N``) and ``ac=full|selective|op|none`` (``recompute`` all, selective, op or none). The planner
  finishes the rest: the layer cuts, and every placement the rule leaves free.

PATTERN is a glob over dotted names: ``*`` matches any run of characters, ``?`` one, and a
dotted component ``a-b`` any whole number from ``a`` to ``b`` (``h.0-7``). A pattern matches a
module and with it everything under it.

Pins are constraints of the searches, not overrides: a pinned placement is the only strategy
its node keeps in the intra-op ILP (:func:`autoplan.planner.mesh_plan.plan_intra_op`), so
every resharding it forces is paid for in the objective; stage pins constrain the stage DP
(:class:`autoplan.solvers.inter_op.InterOpProblem`). :func:`check_pins` refuses, before any
solving and in one line, a pin that matches nothing or cannot hold.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from autoplan.errors import AutoplanError
from autoplan.sharding import Placement, ShardingSpec, parse_placement
from autoplan.strategies.candidates import Strategy
from autoplan.trace.graph import NodeInfo, TracedGraph
from autoplan.trace.layers import Layer

STRUCTURE_KEYS = ("mesh", "tp", "dp", "fsdp", "zero", "pp", "stages", "microbatches", "ac")
DEGREE_KEYS = ("tp", "dp", "fsdp", "stages", "microbatches")


class PinKind(str, Enum):
    PLACEMENT = "placement"  # PATTERN=[S(0), R]
    FSDP = "fsdp"  # PATTERN=fsdp
    ZERO2 = "zero2"  # PATTERN=zero2
    STAGE = "stage"  # PATTERN=stage:N
    CHECKPOINT = "checkpoint"  # PATTERN=checkpoint
    MESH = "mesh"  # mesh=2x4
    TENSOR_PARALLEL = "tp"  # tp=8
    STAGES = "stages"  # stages=2 (or pp=2)
    MICROBATCHES = "microbatches"  # microbatches=32
    DATA_PARALLEL = "dp"  # dp=2
    SHARDED_DATA_PARALLEL = "fsdp=N"  # fsdp=4
    ZERO = "zero"  # zero=1
    ACTIVATION_CHECKPOINTING = "ac"  # ac=full


STORAGE_KINDS = (PinKind.FSDP, PinKind.ZERO2)  # how a parameter is stored, pinned by its FQN
STRUCTURE_KINDS = (PinKind.MESH, PinKind.TENSOR_PARALLEL, PinKind.STAGES, PinKind.MICROBATCHES, PinKind.DATA_PARALLEL,
                   PinKind.SHARDED_DATA_PARALLEL, PinKind.ZERO, PinKind.ACTIVATION_CHECKPOINTING)


@dataclass(frozen=True)
class Pin:
    """One pin as written (``text``) and as read."""

    text: str
    kind: PinKind
    pattern: str = ""
    placement: tuple[Placement | None, ...] = ()  # PLACEMENT: per mesh axis, None for "*"
    number: int = 0  # STAGE: the stage; a degree, a count or the ZeRO stage
    mesh: tuple[int, ...] = ()  # MESH
    choice: str = ""  # ACTIVATION_CHECKPOINTING: full or none
    regex: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    @property
    def is_structure(self) -> bool:
        return self.kind in STRUCTURE_KINDS

    def matches(self, name: str) -> bool:
        """Whether the dotted ``name`` (or a module above it) is matched by the pattern."""
        if self.regex is None or not name:
            return False
        parts = name.split(".")
        return any(self.regex.fullmatch(".".join(parts[:i])) for i in range(len(parts), 0, -1))

    def allows(self, spec: ShardingSpec, mesh_shape: tuple[int, ...]) -> bool:
        """Whether a value may be stored (or produced) in ``spec`` under this pin."""
        if self.kind == PinKind.PLACEMENT:
            return len(spec) == len(self.placement) and all(
                want is None or want == have for want, have in zip(self.placement, spec))
        if self.kind == PinKind.FSDP:
            return all(p.is_shard for p, n in zip(spec, mesh_shape) if n > 1)
        if self.kind == PinKind.ZERO2:
            return all(p.is_replicate for p in spec)
        return True

    def allows_strategy(self, strategy: Strategy, mesh_shape: tuple[int, ...]) -> bool:
        """Whether a value may be stored (or produced) by ``strategy`` under this pin: a ZeRO-2
        pin also asks for the gradient and optimizer state sharded alike, not held."""
        if not self.allows(strategy.output_specs[0], mesh_shape):
            return False
        if self.kind == PinKind.ZERO2:
            grad = strategy.grad_spec
            return grad is not None and grad != strategy.output_specs[0] and strategy.state_spec == grad \
                and not strategy.held
        return True


def module_layers(pin: Pin, layers: list[Layer], graph: TracedGraph) -> list[int]:
    """The indices of the layers that hold an op of a module ``pin`` matches."""
    return [i for i, layer in enumerate(layers)
            if any(pin.matches(graph.nodes[n].module) for n in layer.nodes if n in graph.nodes)]


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The regular expression of a pin's glob (see the module docstring)."""
    out = []
    for i, part in enumerate(pattern.split(".")):
        if i:
            out.append(r"\.")
        numbers = re.fullmatch(r"(\d+)-(\d+)", part)
        if numbers:
            low, high = int(numbers.group(1)), int(numbers.group(2))
            if low > high:
                raise AutoplanError(f"pin pattern {pattern!r}: the range {part} runs backwards: write "
                                    f"{high}-{low}")
            out.append("(?:" + "|".join(str(n) for n in range(low, high + 1)) + ")")
            continue
        out.append("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in part))
    return re.compile("".join(out))


def _placement(text: str, pin: str) -> tuple[Placement | None, ...]:
    inner = text.strip()[1:-1]
    items = [x.strip() for x in inner.split(",")] if inner.strip() else []
    if not items:
        raise AutoplanError(f"pin {pin!r} gives no placement: write one per mesh axis, like [R, S(0)]")
    try:
        return tuple(None if x == "*" else parse_placement(x) for x in items)
    except ValueError:
        raise AutoplanError(f"cannot read the placement of pin {pin!r}: write one of R, P, S(d) or * per "
                            f"mesh axis, like [R, S(0)]") from None


def _count(key: str, value: str, pin: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise AutoplanError(f"pin {pin!r}: {key} must be a whole number of at least 1")
    return int(value)


def parse_pin(text: str) -> Pin:
    """Read one pin (see the module docstring); a bad one is named in one line."""
    if "=" not in text:
        raise AutoplanError(f"cannot read pin {text!r}: write PATTERN=PLACEMENT (h.*.mlp.c_fc.weight=[S(0)]), "
                            f"PATTERN=stage:N, PATTERN=checkpoint, PATTERN=fsdp, PATTERN=zero2 or one of "
                            f"{', '.join(k + '=N' for k in STRUCTURE_KEYS)}")
    pattern, value = (x.strip() for x in text.split("=", 1))
    if not pattern or not value:
        raise AutoplanError(f"cannot read pin {text!r}: both sides of = must be given")
    if pattern == "mesh":
        from autoplan.planner.meshes import parse_mesh

        return Pin(text, PinKind.MESH, mesh=parse_mesh(value))
    if pattern in DEGREE_KEYS:
        kind = PinKind.SHARDED_DATA_PARALLEL if pattern == "fsdp" else PinKind(pattern)
        return Pin(text, kind, number=_count(pattern, value, text))
    if pattern == "pp":
        return Pin(text, PinKind.STAGES, number=_count(pattern, value, text))
    if pattern == "zero":
        if value not in ("1", "2"):
            raise AutoplanError(f"pin {text!r}: write zero=1 (optimizer state sharded over dp) or zero=2 (gradients "
                                f"too); zero=3 is fsdp=N")
        return Pin(text, PinKind.ZERO, number=int(value))
    if pattern == "ac":
        if value not in ("full", "selective", "op", "none"):
            raise AutoplanError(f"pin {text!r}: write ac=full (every layer recomputed), ac=selective (every layer "
                                f"recomputed but its matrix products and attention), ac=op (torchtitan's per-op "
                                f"policy: but its attention and every other matrix product) or ac=none")
        return Pin(text, PinKind.ACTIVATION_CHECKPOINTING, choice=value)
    regex = pattern_regex(pattern)
    if value.startswith("[") and value.endswith("]"):
        return Pin(text, PinKind.PLACEMENT, pattern, placement=_placement(value, text), regex=regex)
    stage = re.fullmatch(r"stage\s*:\s*(\d+)", value)
    if stage:
        return Pin(text, PinKind.STAGE, pattern, number=int(stage.group(1)), regex=regex)
    if value in ("fsdp", "zero2", "checkpoint"):
        return Pin(text, PinKind(value), pattern, regex=regex)
    raise AutoplanError(f"cannot read the value of pin {text!r}: write a placement like [R, S(0)], stage:N, "
                        f"checkpoint, fsdp or zero2")


def pin_file_texts(path: str | Path) -> list[str]:
    """The pins of a TOML pin file as ``PATTERN=VALUE`` texts: top-level keys and those of a
    ``[pins]`` table, a placement given as a string (``"[R, S(0)]"``) or a list
    (``["R", "S(0)"]``), counts as numbers or strings."""
    file = Path(path)
    if not file.is_file():
        raise AutoplanError(f"pin file {path} does not exist: give the path of a TOML file of PATTERN = VALUE lines")
    try:
        data = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as e:
        raise AutoplanError(f"cannot read pin file {path}: {e}") from None
    table = dict(data.pop("pins", {}))
    return [f"{key}={_toml_value(value)}" for key, value in [*data.items(), *table.items()]]


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(str(x) for x in value) + "]"
    return str(value)


@dataclass(frozen=True)
class PinSet:
    """The pins of one planning run. ``meshes``: where :func:`check_pins` has run, the logical
    meshes on which every placement pin can hold (None: not checked, every mesh). ``tied``:
    the model's tied parameters (:attr:`TracedGraph.tied`, as pairs), so that a pin naming
    either FQN of one tensor holds the placeholder the graph reads."""

    pins: tuple[Pin, ...] = ()
    meshes: frozenset[tuple[int, ...]] | None = None
    tied: tuple[tuple[str, str], ...] = ()

    @classmethod
    def read(cls, texts: Iterable[str] | Mapping[str, Any]) -> PinSet:
        if isinstance(texts, Mapping):
            texts = [f"{k}={_toml_value(v)}" for k, v in texts.items()]
        if isinstance(texts, str):
            texts = [texts]
        pins = tuple(parse_pin(t) for t in texts)
        seen: dict[PinKind, Pin] = {}
        for pin in pins:
            if pin.is_structure:
                if pin.kind in seen and seen[pin.kind] != pin:
                    raise AutoplanError(f"pins {seen[pin.kind].text!r} and {pin.text!r} disagree: keep one")
                seen[pin.kind] = pin
        ndims = {len(p.placement) for p in pins if p.kind == PinKind.PLACEMENT}
        if len(ndims) > 1:
            first = {len(p.placement): p.text for p in pins if p.kind == PinKind.PLACEMENT}
            raise AutoplanError(f"the placement pins give different numbers of mesh axes ("
                                f"{'; '.join(f'{t!r}: {n}' for n, t in sorted(first.items()))}): one mesh has one "
                                f"number of axes")
        return cls(pins)

    def __bool__(self) -> bool:
        return bool(self.pins)

    def of_kind(self, *kinds: PinKind) -> list[Pin]:
        return [p for p in self.pins if p.kind in kinds]

    def structure(self, kind: PinKind) -> Pin | None:
        return next(iter(self.of_kind(kind)), None)

    @property
    def mesh_ndim(self) -> int | None:
        """The number of mesh axes the placement pins (or a mesh pin) fix, if any."""
        placed = self.of_kind(PinKind.PLACEMENT)
        if placed:
            return len(placed[0].placement)
        mesh = self.structure(PinKind.MESH)
        return len(mesh.mesh) if mesh else None

    def degree(self, kind: PinKind) -> int | None:
        """The number a structure pin of ``kind`` gives (None: no such pin)."""
        pin = self.structure(kind)
        return pin.number if pin else None

    @property
    def data_parallel_mesh(self) -> tuple[int, ...] | None:
        """With ``dp=`` or ``fsdp=`` pins: each stage's mesh, ``--manual``'s (the degrees above
        1 of dp, fsdp and tp, in that order); None without them."""
        dp, fsdp = self.degree(PinKind.DATA_PARALLEL), self.degree(PinKind.SHARDED_DATA_PARALLEL)
        if dp is None and fsdp is None:
            return None
        return tuple(d for d in (dp or 1, fsdp or 1, self.degree(PinKind.TENSOR_PARALLEL) or 1) if d > 1) or (1,)

    def value_pins(self, info: NodeInfo) -> list[Pin]:
        """The placement, fsdp and zero2 pins that hold ``info``'s value: parameters and buffers
        by FQN, user inputs and ops by node name (fsdp and zero2 pins hold trained parameters
        only)."""
        if not self.pins:
            return []
        named = info.fqn if info.kind in ("parameter", "buffer") and info.fqn else info.name
        names = [named, *(other for other, read in self.tied if read == named)]
        return [p for p in self.pins if (p.kind == PinKind.PLACEMENT or (p.kind in STORAGE_KINDS and
                                                                          info.kind == "parameter"))
                and any(p.matches(name) for name in names)]

    def allows(self, info: NodeInfo, spec: ShardingSpec, mesh_shape: tuple[int, ...]) -> bool:
        return all(p.allows(spec, mesh_shape) for p in self.value_pins(info))

    def key(self, info: NodeInfo) -> tuple[str, ...]:
        """What distinguishes ``info``'s pins (members of a class of repeated nodes pinned
        differently must not share a strategy)."""
        return tuple(p.text for p in self.value_pins(info))

    def mesh_allowed(self, mesh: tuple[int, ...]) -> bool:
        """Whether the placement pins can hold on a logical mesh of shape ``mesh``."""
        ndim = self.mesh_ndim if self.of_kind(PinKind.PLACEMENT) else None
        if ndim is not None and len(mesh) != ndim:
            return False
        tp = self.degree(PinKind.TENSOR_PARALLEL)
        if tp is not None and mesh[-1] != tp:
            return False
        return self.meshes is None or mesh in self.meshes

    def sign_layers(self, graph: TracedGraph, layers: list[Layer]) -> list[Layer]:
        """``layers`` with the pins that hold their values (and the parameters they read) in
        their signatures: layers of equal ops share costs only where they are pinned alike."""
        if not self.of_kind(PinKind.PLACEMENT, *STORAGE_KINDS):
            return layers
        by_fqn = {info.fqn: info for info in graph.nodes.values() if info.fqn}
        signed = []
        for layer in layers:
            held = []
            for position, name in enumerate(layer.nodes):
                info = graph.nodes.get(name)
                if info is None:
                    continue
                read = [by_fqn[fqn] for fqn in info.params if fqn in by_fqn]
                keys = [self.key(x) for x in (info, *read)]
                if any(keys):
                    held.append((position, tuple(keys)))
            digest = hashlib.sha256(repr(held).encode()).hexdigest()[:16]  # the same in every process and run
            signed.append(replace(layer, signature=f"{layer.signature}|pins {digest}") if held else layer)
        return signed

    @property
    def least_stages(self) -> int:
        """The fewest pipeline stages the stage pins allow (1 without any)."""
        return max((p.number for p in self.of_kind(PinKind.STAGE)), default=-1) + 1

    def layer_stages(self, graph: TracedGraph, layers: list[Layer]) -> tuple[tuple[int, int], ...]:
        """The stage pins as (layer index, stage) pairs for the stage DP; a layer two pins put in
        different stages is refused in one line."""
        stage_of: dict[int, Pin] = {}
        for pin in self.of_kind(PinKind.STAGE):
            for i in module_layers(pin, layers, graph):
                other = stage_of.setdefault(i, pin)
                if other.number != pin.number:
                    raise AutoplanError(f"pins {other.text!r} and {pin.text!r} put layer {layers[i].name} in two "
                                        f"stages: a layer lies in one stage")
        return tuple(sorted((i, pin.number) for i, pin in stage_of.items()))

    def checkpointed_layers(self, graph: TracedGraph, layers: list[Layer]) -> frozenset[int]:
        """The indices of the layers the checkpoint pins recompute."""
        return frozenset(i for pin in self.of_kind(PinKind.CHECKPOINT) for i in module_layers(pin, layers, graph))

    def texts(self) -> list[str]:
        return [p.text for p in self.pins]
