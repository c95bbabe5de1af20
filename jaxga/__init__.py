"""jaxga: the batch size you want on the accelerator memory you have, with exact results."""

from jaxga import collectives, sharding
from jaxga.accumulation import Accumulate, accumulate, grad, value_and_grad
from jaxga.compiler import compiler_options
from jaxga.convolution import canonical_convolutions
from jaxga.engine import Accumulated
from jaxga.loss import Mean, checkify_values, token_cross_entropy
from jaxga.memory import MemoryReport, memory_report, parse_bytes
from jaxga.microbatch import merge_microbatches, split_microbatches
from jaxga.multistep import MultiSteps, MultiStepsState, MultiStepsTransformation, skip_not_finite
from jaxga.nnx_train import NNXTrainStep, nnx_loss, nnx_train_step
from jaxga.pipeline import pipeline_loss, pipeline_order, pipeline_scan
from jaxga.planner import Plan, plan
from jaxga.remat import checkpoint_policy, remat_scan
from jaxga.state import TrainState
from jaxga.steps import StepOptions
from jaxga.train import TrainStep, make_train_step

__version__ = "0.1.0"

__all__ = [
    "Accumulate",
    "Accumulated",
    "Mean",
    "MemoryReport",
    "MultiSteps",
    "MultiStepsState",
    "MultiStepsTransformation",
    "NNXTrainStep",
    "Plan",
    "StepOptions",
    "TrainState",
    "TrainStep",
    "accumulate",
    "canonical_convolutions",
    "checkify_values",
    "checkpoint_policy",
    "collectives",
    "compiler_options",
    "grad",
    "make_train_step",
    "memory_report",
    "merge_microbatches",
    "nnx_loss",
    "nnx_train_step",
    "parse_bytes",
    "pipeline_loss",
    "pipeline_order",
    "pipeline_scan",
    "plan",
    "remat_scan",
    "sharding",
    "skip_not_finite",
    "split_microbatches",
    "token_cross_entropy",
    "value_and_grad",
]
