"""The module state a forward reads besides parameters and inputs: every module's attributes and buffers.

A forward may read — and change — state that is neither a parameter nor an
input: the train/eval flag (an RL loop switches to `eval()` to sample before it
backwards), a buffer it recomputes (dynamic RoPE registers a new `inv_freq`
when a longer row comes, and moves `max_seq_len_cached` with it), the adapter
peft runs. A replay must start from the state its forward started from, and the
caller must find its own state afterwards: plain autograd never runs a forward
again, so a backward leaves module state as it was.

`ModuleState.capture` keeps, per module, a shallow copy of its attributes and
of its buffer table — references: no tensor is copied. Parameters
(`_parameters`: the replay checks their versions, the trainer swaps weight
snapshots in) and submodules (`_modules`: the structure) are not part of it.
A buffer changed *in place* keeps its new values (nothing was copied); the
replay's bitwise check of its outputs catches what that changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

# Structure, not state; the buffer tables are copied by content (register_buffer changes them in place).
_NOT_ATTRIBUTES = frozenset({"_parameters", "_modules", "_buffers", "_non_persistent_buffers_set"})


@dataclass(frozen=True)
class _Snapshot:
    module: nn.Module
    attributes: dict
    buffers: dict
    non_persistent: frozenset

    @classmethod
    def of(cls, module: nn.Module) -> "_Snapshot":
        attributes = {key: value for key, value in vars(module).items() if key not in _NOT_ATTRIBUTES}
        return cls(module, attributes, dict(module._buffers), frozenset(module._non_persistent_buffers_set))

    def apply(self) -> None:
        state = vars(self.module)
        for key in [key for key in state if key not in _NOT_ATTRIBUTES and key not in self.attributes]:
            del state[key]  # set after the snapshot was taken
        for key, value in self.attributes.items():
            if state.get(key, _MISSING) is not value:
                state[key] = value
        buffers = self.module._buffers
        if buffers.keys() != self.buffers.keys() or any(buffers[k] is not v for k, v in self.buffers.items()):
            buffers.clear()
            buffers.update(self.buffers)
        if self.module._non_persistent_buffers_set != self.non_persistent:
            self.module._non_persistent_buffers_set.clear()
            self.module._non_persistent_buffers_set.update(self.non_persistent)


_MISSING = object()


class ModuleState:
    def __init__(self, snapshots: list[_Snapshot]):
        self._snapshots = snapshots
        # The buffers alone, for `held_bytes` (a model has few; scanning every module per call would not be).
        self._buffers = [(s.module, name, t) for s in snapshots for name, t in s.buffers.items() if t is not None]

    @classmethod
    def capture(cls, modules: Iterable[nn.Module]) -> "ModuleState":
        return cls([_Snapshot.of(module) for module in modules])

    def held_bytes(self) -> int:
        """Bytes of recorded buffers that no recorded module holds as a buffer now (replaced since): this state keeps
        them alive (counted even where a plain attribute holds them too: the bound errs high, never low)."""
        current = {
            buffer.untyped_storage().data_ptr()
            for module, name, _ in self._buffers
            if (buffer := module._buffers.get(name)) is not None
        }
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, _, t in self._buffers}
        return sum(nbytes for pointer, nbytes in held.items() if pointer not in current)

    @contextlib.contextmanager
    def restored(self):
        """Run with every module as recorded; afterwards every module is as the caller had it."""
        caller = ModuleState.capture(s.module for s in self._snapshots)
        try:
            for snapshot in self._snapshots:
                snapshot.apply()
            yield
        finally:
            for snapshot in caller._snapshots:
                snapshot.apply()

    def clear(self) -> None:
        self._snapshots, self._buffers = [], []
