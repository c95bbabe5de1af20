"""jaxga: the batch size you want on the accelerator memory you have, with exact results."""

from jaxga import collectives as collectives
from jaxga import sharding
from jaxga.accumulation import Accumulated, accumulate, grad, value_and_grad
from jaxga.compiler import compiler_options
from jaxga.loss import Mean, as_mean, token_cross_entropy
from jaxga.memory import MemoryReport, memory_report
from jaxga.microbatch import merge_microbatches, split_microbatches
from jaxga.multistep import MultiSteps, MultiStepsState, skip_not_finite
from jaxga.planner import Plan, parse_bytes, plan
from jaxga.remat import checkpoint_policy, remat_scan
from jaxga.state import TrainState
from jaxga.train import make_train_step, nnx_loss, nnx_train_step

__version__ = "0.1.0"

# fmt: off
__all__ = [
    "Accumulated", "Mean", "MemoryReport", "MultiSteps", "MultiStepsState", "Plan",
    "TrainState", "accumulate", "as_mean", "checkpoint_policy", "compiler_options", "grad",
    "make_train_step", "memory_report", "merge_microbatches", "nnx_loss", "nnx_train_step",
    "parse_bytes", "plan", "remat_scan", "sharding", "skip_not_finite", "split_microbatches",
    "token_cross_entropy", "value_and_grad",
]
