"""A window-level loss of your own, on accutrain's gradient-caching base (docs/losses.md), run from the repository's
top folder:

    accutrain debug=fast loss=custom loss._target_=examples.mywindowloss.AlignUniform augment.views=2 augment.crop=pad micro_batch=8 accum=4

Wang & Isola's alignment and uniformity (2020): sample i's loss is ‖z(a_i) − z(p_i)‖² + λ · log mean_c exp(−t ‖z(a_i)
− z(c)‖²) over every candidate c of the WHOLE window (z: the embeddings on the unit sphere). The second term is a
mean over the window, which no micro-batch has alone: as a subclass of WindowLoss, the step is the big batch's under
any micro_batch × accum × devices. A class whose instances implement accutrain's Loss protocol is a family of its own
(its traits are the class's attributes); a plain function would be a per-term loss."""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from accutrain.core.losses.window import WindowLoss


@dataclass
class AlignUniform(WindowLoss):
    weight: float = 1.0  # λ, the uniformity's weight
    t: float = 2.0  # the uniformity's temperature
    name = "align_uniform"

    def per_sample(self, embeddings, rows=None, keys=None):
        z = F.normalize(embeddings, dim=-1)
        rows = rows or slice(0, len(z))
        anchors, candidates = z[rows, 0], z[:, 1:].flatten(0, 1)
        align = (anchors - z[rows, 1]).square().sum(-1)
        uniform = torch.logsumexp(-self.t * torch.cdist(anchors, candidates).square(), 1) - math.log(len(candidates))
        return align + self.weight * uniform
