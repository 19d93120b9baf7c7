"""One step of the online (streaming) softmax that both paged attention kernels run over their key tiles."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(scores, running_max, running_sum):
    """Fold a tile of scaled, masked scores [R, N] into the running max [R] and sum [R]: the tile's unnormalised
    probabilities [R, N], the factor [R] the accumulated output is rescaled by, and the new max and sum. A row
    with nothing visible yet keeps max -inf and gets no NaN from -inf - -inf."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    correction = tl.exp(running_max - safe_max)
    probs = tl.exp(scores - safe_max[:, None])
    return probs, correction, new_max, running_sum * correction + tl.sum(probs, axis=1)
