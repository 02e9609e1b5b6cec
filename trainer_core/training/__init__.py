"""The trainer API: versioned graphs, checkpoints, backward state, staleness, transactional gradients, the step.

    from trainer_core.training import Trainer, OptimizerConfig

Everything a caller needs is re-exported here; the modules hold one concern each.
"""

from .checkpoint_io import export_checkpoint_module, restore_checkpoint, save_checkpoint
from .checkpoints import Checkpoint, OptimizerConfig, StepReport
from .graphs import GraphConsumedError, ManagedOutputs
from .hf_weights import hf_state_dict, save_hf_model
from .memory import (
    BACKWARD_STATES,
    PLANNER,
    BackwardMode,
    MemoryPlanner,
    MissReports,
    NoGradientPathError,
    ReplayMismatchError,
)
from .staleness import StaleGraphError, StalenessPolicy, importance_weights
from .trainer import BackwardReport, Trainer
from .transaction import GradientTransactionError, NonFinitePolicy
from .versions import Version
from .vocab import pad_vocabulary

__all__ = [
    "BACKWARD_STATES",
    "PLANNER",
    "BackwardMode",
    "BackwardReport",
    "Checkpoint",
    "GradientTransactionError",
    "GraphConsumedError",
    "ManagedOutputs",
    "MemoryPlanner",
    "MissReports",
    "NoGradientPathError",
    "NonFinitePolicy",
    "OptimizerConfig",
    "ReplayMismatchError",
    "StaleGraphError",
    "StalenessPolicy",
    "StepReport",
    "Trainer",
    "Version",
    "export_checkpoint_module",
    "hf_state_dict",
    "importance_weights",
    "pad_vocabulary",
    "restore_checkpoint",
    "save_checkpoint",
    "save_hf_model",
]
