"""New weights into a running engine core, without a restart: from a checkpoint directory or from tensors.

Every source reaches the model through the loaders that read checkpoints at start-up (`CheckpointReader`, an
in-memory one for tensors: `weights/memory_tensors.py`), so each rank keeps only its shard and its experts (the
slots of its placement, replicas included), and a weight kept FP8, int8 or int4 is quantized again as it loads.

Nothing is written before everything is checked: each tensor must be one of the served model's (its checkpoint's
names, as transformers names them) with the same shape, a checkpoint directory must carry them all, and an update
of a few tensors must carry every tensor of each module it touches (a module loads its tensors together: an
attention's projections, a layer's experts). Under several ranks they agree on the check before any writes (one
refusal refuses everywhere). A failure after that point is reported as leaving the engine in a mixed state: a
full update (or a restart) must follow.

After an update the prefix cache is flushed (and the KV tiers': `EngineCore.reset_prefix_cache`): cached blocks
were computed with the old weights. Each rank says whether the update carried every tensor of the model
(`UpdateApplied.complete`): the front keeps where the weights came from, which decides what a lost rank's recovery
may read them from (front/weight_sync.py's `WeightOrigin`). The MTP drafter's layer is loaded with the model.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_runtime.engine.sleep_mode import SleepMode
from moe_runtime.engine.weight_update_group import GroupAddress, TensorSpec, WeightUpdateGroup
from moe_runtime.errors import InvalidRequestError
from moe_runtime.moe.expert_weights import ExpertWeights
from moe_runtime.weights.checkpoint import CheckpointReader
from moe_runtime.weights.loading import SkippedTensors, copy_checked, load_model_weights
from moe_runtime.weights.memory_tensors import memory_reader, plain_reader
from moe_runtime.weights.quantization.fp8_block import Fp8BlockFormat

logger = logging.getLogger(__name__)

SHOWN_NAMES = 8
RECEIVE_BATCH_BYTES = 256 * 2**20   # a trainer's broadcast is loaded module by module in batches about this size


class WeightUpdateRefused(InvalidRequestError):
    """The update does not fit the served model; nothing was written."""


class WeightUpdateBroken(RuntimeError):
    """The update failed while writing: some weights are new, some old (a full update or restart must follow)."""


@dataclass(frozen=True)
class UpdateApplied:
    """What an update did on this rank: the tensors it loaded, and whether it carried every tensor of the model
    (`complete`: no weight is left from before it, so the weights are exactly its source's)."""

    tensors: int
    complete: bool


@dataclass(frozen=True)
class SlotChecksum:
    """A routed-expert slot's weights summarized (a trainer, or a test, checks a rank holds what it sent):
    sums of the values and of their squares, of w13 and w2, in float64."""

    layer: int
    slot: int
    expert: int
    sums: tuple[float, float, float, float]


def _shown(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
    return ", ".join(repr(n) for n in names[:SHOWN_NAMES]) + more


class WeightUpdater:
    """One core's weight updates, and its sleep mode (`sleep`: dropped weights). `core`: an `EngineCore`."""

    def __init__(self, core):
        self.core = core
        self.sleep = SleepMode(core)   # sleep / wake_up: an update refuses (or restores) dropped weights
        self.directory = Path(core.checkpoint_dir)   # the checkpoint the weights last came from whole
        self._reference: CheckpointReader | None = None
        self.group: WeightUpdateGroup | None = None   # the trainer's, once joined

    # ---- the served model's tensors -------------------------------------------------------------------
    def _open(self, directory: Path, plain: bool = False) -> CheckpointReader:
        """`plain`: tensors an update from tensors wrote (not a checkpoint: no quantization config applies)."""
        core = self.core
        if plain:
            reader = plain_reader(directory, core.hf_config)
        else:
            reader = CheckpointReader.open(directory, Fp8BlockFormat.from_hf_config(core.hf_config, str(directory)),
                                           core.hf_config)
        self._rename_as_model(reader)
        return reader

    def _rename_as_model(self, reader: CheckpointReader) -> None:
        if hasattr(self.core.model, "checkpoint_name"):   # DeepSeek-V4: the model reads other names
            reader.renamed(self.core.model.checkpoint_name)

    def reference(self) -> CheckpointReader:
        """The start-up checkpoint's names and shapes: what every update is checked against."""
        if self._reference is None:
            self._reference = self._open(Path(self.core.checkpoint_dir))
        return self._reference

    # ---- the sources ----------------------------------------------------------------------------------
    def from_directory(self, path: str, partial: bool = False, whole: bool = False) -> UpdateApplied:
        """Load a checkpoint directory, or (`partial`) the plain tensors an update from tensors wrote for the ranks
        (some of the model's). `whole`: refused unless it carries every tensor (the front lost the weights)."""
        directory = Path(path)
        reader, error = None, None
        try:
            reader = self._open(directory, plain=partial)
        except Exception as exc:   # noqa: BLE001 - nothing written yet: a refusal, agreed on below (the others wait)
            error = f"path: {exc}"
        applied = self._apply(reader, partial, label=str(directory), keep_sources=partial, error=error, whole=whole)
        if not partial:
            self.directory = directory
        return applied

    def from_tensors(self, tensors: dict[str, torch.Tensor], partial: bool = True,
                     whole: bool = False) -> UpdateApplied:
        reader = memory_reader(tensors, self.core.hf_config)
        self._rename_as_model(reader)
        return self._apply(reader, partial, label="the update's tensors", keep_sources=True, whole=whole)

    def join_group(self, address: GroupAddress) -> None:
        """Join the trainer's weight-update group as group rank `rank_offset` + this rank (leaving any earlier one).
        The ranks agree on the outcome: all are in the group, or none (an update then finds the same on every rank)."""
        self.close()
        error = None
        try:
            self.group = WeightUpdateGroup(address, self.core.parallel.rank, self.core.device)
        except Exception as exc:   # noqa: BLE001 - no trainer there (the store's timeout), a refused connection
            error = f"joining the trainer's group at {address.master_address}:{address.master_port}: {exc}"
        error = self._agree(error)
        if error is not None:
            self.close()
            raise WeightUpdateRefused(error)

    def close(self) -> None:
        """Leave the trainer's group (on shutdown: its threads would otherwise outlive the engine)."""
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def from_distributed(self, specs: list[TensorSpec], whole: bool = False) -> UpdateApplied:
        """Check `specs` against the served model (names, shapes, dtypes) and agree on it with the other ranks and
        the trainer (`WeightUpdateGroup.verdict`: its send raises on a refusal), then receive the trainer's
        broadcast of them (every tensor whole) in batches of whole modules, loading what this rank holds of each
        before receiving the next."""
        group = self.group
        if group is None:
            raise WeightUpdateRefused("update_weights_from_distributed: no weight-update group; call "
                                      "init_weights_update_group first")
        hf_config = self.core.hf_config
        outline = memory_reader({s.name: torch.empty(s.shape, dtype=s.torch_dtype(), device="meta") for s in specs},
                                hf_config)   # names and shapes only: nothing received yet
        self._rename_as_model(outline)
        model_name = {original: name for name, original in outline.stored_names.items()}
        module_of = self._module_of()

        def batches():
            for tensors in group.receive(specs, lambda name: module_of(model_name.get(name, name)), RECEIVE_BATCH_BYTES):
                reader = memory_reader(tensors, hf_config)
                self._rename_as_model(reader)
                yield reader
        try:
            error = self._dtype_error(specs, model_name)
        except Exception as exc:   # noqa: BLE001 - still agreed on (the other ranks wait for this one's verdict)
            error = f"the trainer's broadcast: {exc}"
        return self._apply(outline, True, label="the trainer's broadcast", keep_sources=True, whole=whole,
                           error=error, announce=group.verdict, writes=batches)

    def _dtype_error(self, specs: list[TensorSpec], model_name: dict[str, str]) -> str | None:
        """A tensor sent in a dtype the model cannot take: weights are floating point (a module kept quantized
        quantizes them as it loads); integers only where the served checkpoint stores integers itself."""
        reference = self.reference()
        for spec in specs:
            dtype = spec.torch_dtype()
            if dtype.is_floating_point:
                continue
            name = model_name.get(spec.name, spec.name)
            stored = reference.stored_dtype(name) if reference.has(name) else None
            if stored is None or not stored.startswith(("I", "U")) or dtype.is_complex or dtype == torch.bool:
                return (f"dtypes: tensor {spec.name!r} is {spec.dtype}; the served model's weights take a floating-point "
                        "dtype")
        return None

    def _module_of(self):
        """name -> the module it loads with (the outermost custom module it is in: a module loads its tensors,
        those of modules inside it included, together), or itself (a plain parameter loads alone)."""
        prefixes = sorted(self._module_prefixes(), key=len)
        return lambda name: next((prefix for prefix in prefixes if name.startswith(prefix)), name)

    def reload_checkpoint(self) -> None:
        """The whole checkpoint the weights last came from, loaded as at start-up (a wake-up from sleep level 2)."""
        core = self.core
        load_model_weights(core.model, self._open(self.directory), SkippedTensors.for_config(core.hf_config),
                           self._group())
        core.executor.weights_changed()

    # ---- check, agree, write --------------------------------------------------------------------------
    def _group(self):
        parallel = self.core.parallel
        return parallel.world_control_group if parallel.world_size > 1 else None

    def _apply(self, reader: CheckpointReader | None, partial: bool, label: str, keep_sources: bool,
               error: str | None = None, whole: bool = False, announce=None, writes=None) -> UpdateApplied:
        """Check `reader` (its names and shapes), agree, then write. `announce(error)`: tells the sender the agreed
        verdict before anything is written; `writes()`: the readers to load one after the other (default: `reader`
        itself), read only once agreed."""
        started = time.perf_counter()
        complete = False
        if error is None:
            try:
                error = self._check(reader, partial, whole)
                complete = not self._missing(reader)
            except Exception as exc:   # noqa: BLE001 - any failure before the writes is a refusal, on every rank alike
                error = f"{label}: {exc}"
        error = self._agree(error)
        if announce is not None:
            announce(error)
        if error is not None:
            raise WeightUpdateRefused(error)
        loaded, read = 0, 0
        try:
            with torch.no_grad(), self.sleep.weights_restored():   # a full update brings dropped weights back
                for batch in (writes() if writes is not None else [reader]):
                    loaded += self._load(batch, keep_sources)
                    read += batch.bytes_read
        except Exception as exc:   # noqa: BLE001 - checked first: this is a fault, and the weights are mixed now
            raise WeightUpdateBroken(f"writing {label} failed after some weights were replaced ({exc}); the engine "
                                     "holds a mix of old and new weights: update it from a full checkpoint, or "
                                     "restart it") from exc
        self.core.reset_prefix_cache()   # blocks cached under the old weights
        logger.info("weights updated from %s: %d tensors (%.1f MiB read) in %.2fs", label, loaded,
                    read / 2**20, time.perf_counter() - started)
        return UpdateApplied(loaded, complete)

    def _missing(self, reader: CheckpointReader) -> set[str]:
        """The served model's tensors `reader` lacks (the deliberately skipped ones aside)."""
        skipped = SkippedTensors.for_config(self.core.hf_config)
        return {n for n in set(self.reference().names()) - set(reader.names()) if skipped.rule_for(n) is None}

    def _check(self, reader: CheckpointReader, partial: bool, whole: bool = False) -> str | None:
        """What refuses the update (naming the tensors), or None."""
        reference = self.reference()
        given = set(reader.names())
        expected = set(reference.names())
        if not given:
            return "the update carries no tensor"
        unknown = given - expected
        if unknown:
            return f"tensor(s) {_shown(unknown)} are not the served model's ({self.core.architecture})"
        if self.sleep.weights_on_host:
            return ("the engine sleeps at level 1 with its weights in host memory: wake_up first, or sleep at level 2 "
                    "and update from a full checkpoint")
        skipped = SkippedTensors.for_config(self.core.hf_config)
        missing = self._missing(reader)
        if whole and missing:
            return ("the weights were lost with a rank after an update from memory: only an update carrying every "
                    f"tensor of the model restores them (this one lacks {_shown(missing)})")
        if self.sleep.weights_dropped and missing:
            return ("the weights were dropped (sleep level 2): only a full checkpoint brings them back "
                    "(every tensor of the model, from any source, or wake_up(reload=True))")
        if not partial and missing:
            return f"the checkpoint lacks tensor(s) {_shown(missing)} of the served model"
        for name in sorted(given):
            shape, wanted = reader.shape(name), reference.shape(name)
            if tuple(shape) != tuple(wanted):
                return f"tensor {name!r} has shape {tuple(shape)}, the served model's is {tuple(wanted)}"
        if partial:
            for prefix in self._module_prefixes():
                mine = {n for n in given if n.startswith(prefix)}
                lacking = {n for n in expected if n.startswith(prefix)} - given if mine else set()
                lacking = {n for n in lacking if skipped.rule_for(n) is None}
                if lacking:
                    return (f"module {prefix.rstrip('.')!r} loads its tensors together: the update has "
                            f"{_shown(mine)} but lacks {_shown(lacking)}")
        return None

    def _agree(self, error: str | None) -> str | None:
        """Every rank refuses if one does (each sees the same tensors, but a rank may fail to read its files)."""
        group = self._group()
        if group is None:
            return error
        flag = torch.tensor([int(error is not None)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and error is None:
            return "another rank refused the update (its error is in its log)"
        return error

    def _targets(self) -> list[tuple[torch.nn.Module, object]]:
        """What an update loads into, under the checkpoint's names, each with its MoE executor: the model, and
        the MTP drafter's layer (its tensors are the checkpoint's too: left old, its drafts would silently
        stop being accepted)."""
        core = self.core
        targets = [(core.model, core.executor)]
        drafter = core.speculation.local_model_drafter() if core.speculation is not None else None
        view = getattr(drafter, "checkpoint_view", None)   # an EAGLE-3 head has none: its own checkpoint
        if view is not None:
            targets.append((view, drafter.executor))
        return targets

    def _custom_modules(self) -> list[tuple[str, object]]:
        """(the checkpoint prefix its tensors have, module) of every module that loads its own: its path in the
        model, or the prefix it declares (`checkpoint_prefix`: the transformers backend's model reads every
        checkpoint name, mapped by transformers' rules)."""
        return [(getattr(module, "checkpoint_prefix", f"{name}." if name else ""), module)
                for target, _ in self._targets()
                for name, module in target.named_modules() if hasattr(module, "load_weights") and module is not target]

    def _module_prefixes(self) -> list[str]:
        return [prefix for prefix, _ in self._custom_modules()]

    def _load(self, reader: CheckpointReader, keep_sources: bool) -> int:
        """Load the tensors `reader` has: each module whose tensors are among them, then the plain parameters.
        `keep_sources`: expert slots keep the checkpoint they reload from when a rank is lost (the tensors come
        from memory or from a directory that goes away)."""
        given = set(reader.names())
        experts = [m for _, m in self._custom_modules() if isinstance(m, ExpertWeights)]
        sources = [m._source for m in experts]   # a lost expert slot reloads from its checkpoint, not from memory
        # (which then no longer describes it: the front ends the requests rather than resume them on a mix)
        loaded: set[str] = set()
        for prefix, module in self._custom_modules():
            if any(name.startswith(prefix) for name in given):
                loaded.update(prefix + relative for relative in module.load_weights(reader, prefix))
        params = {name: param for target, _ in self._targets() for name, param in target.named_parameters()}
        for name in sorted(given):
            if name in params and name not in loaded:
                copy_checked(params[name], reader.read(name), name, reader.directory)
                loaded.add(name)
        if keep_sources:
            for module, source in zip(experts, sources):
                module._source = source
        for _, executor in self._targets():
            if executor is not None:
                executor.weights_changed()
        return len(reader.consumed)

    # ---- what a trainer checks ------------------------------------------------------------------------
    def slot_checksums(self) -> list[SlotChecksum]:
        """Every routed-expert slot of this rank, summarized (`SlotChecksum`)."""
        sums = []
        executor = self.core.executor
        for layer in range(executor.num_moe_layers):
            experts = executor.expert_store(layer)
            for slot, expert in enumerate(experts.expert_ids):
                w13, w2 = experts.w13[slot].double(), experts.w2[slot].double()
                sums.append(SlotChecksum(layer, slot, expert, (float(w13.sum()), float((w13 * w13).sum()),
                                                               float(w2.sum()), float((w2 * w2).sum()))))
        return sums
