"""jaxga: the batch size you want on the accelerator memory you have, with exact results."""

from jaxga import sharding
from jaxga.accumulation import (
    Accumulated,
    accumulate,
    grad,
    split_microbatches,
    value_and_grad,
)
from jaxga.loss import Mean, as_mean, token_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "Accumulated",
    "Mean",
    "accumulate",
    "as_mean",
    "grad",
    "sharding",
    "split_microbatches",
    "token_cross_entropy",
    "value_and_grad",
]
