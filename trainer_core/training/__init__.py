"""The trainer API: versioned graphs, checkpoints, backward state, staleness, transactional gradients, the step.

    from trainer_core.training import Trainer, OptimizerConfig

Everything a caller needs is re-exported here; the modules hold one concern each.
"""

from .checkpoint_io import export_checkpoint_module, restore_checkpoint, save_checkpoint
from .checkpoints import Checkpoint, OptimizerConfig, StepReport
from .graphs import GraphConsumedError, ManagedOutputs
from .memory import BackwardMode, MemoryPlanner
from .staleness import StaleGraphError, StalenessPolicy, importance_weights
from .trainer import BackwardReport, Trainer
from .transaction import GradientTransactionError, NonFinitePolicy
from .versions import Version

__all__ = [
    "BackwardMode", "BackwardReport", "Checkpoint", "GradientTransactionError", "GraphConsumedError", "ManagedOutputs",
    "MemoryPlanner", "NonFinitePolicy", "OptimizerConfig", "StaleGraphError", "StalenessPolicy", "StepReport",
    "Trainer", "Version", "export_checkpoint_module", "importance_weights", "restore_checkpoint", "save_checkpoint",
]
