"""Model FLOPs of a training step, for the model-FLOP utilisation (`mfu`) in train_log.jsonl.

Matrix multiply-adds count 2 FLOPs each (the usual convention); element-wise work, norms and softmaxes are left out:
- the frozen target's forward over every token: 2 x (the parameters of its decoder layers) per token, plus causal
  attention, 2 x 2 x hidden x n^2 / 2 per layer for a document of n tokens (QK^T and PV);
- the teacher's logits: 2 x hidden x vocabulary per supervising position (the rows of the teacher table);
- the drafter's forward and backward over every element it runs: 6 x (the parameters of fc and its layers) per
  element. Its attention is left out (how much of it the block mask keeps depends on the layout), so the count is
  a lower bound;
- the draft head over every charged element: 2 x d x draft vocabulary forward, as much again for the gradient of its
  input, and again for its weight when the head is trained.
The peak is the dense bf16 matrix rate measured on random data on the GPU kind (H100 and H200: about 790 TFLOP/s),
not the datasheet's; other devices report no utilisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle.drafters.drafter import Drafter
from peagle.models.llama import LlamaModel
from peagle.training.plan import StepPlan

MEASURED_PEAK_BF16 = {"H100": 790e12, "H200": 790e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in MEASURED_PEAK_BF16.items() if key in name), None)


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@dataclass(frozen=True, slots=True)
class StepFlops:
    target_layer_params: int
    target_layers: int
    target_hidden: int
    target_vocab: int
    drafter_params: int  # fc and the layers
    head_params: int  # d x draft vocabulary
    head_trained: bool

    @classmethod
    def of(cls, target: LlamaModel, drafter: Drafter) -> "StepFlops":
        cfg = target.config
        return cls(_params(target.layers), cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size,
                   _params(drafter.fc) + _params(drafter.layers), drafter.lm_head.weight.numel(),
                   drafter.lm_head.weight.requires_grad)

    def step(self, plan: StepPlan) -> float:
        """FLOPs of one micro-batch's plan (see the module docstring)."""
        lengths = plan.sequence.doc_lengths
        target = 2 * self.target_layer_params * sum(lengths) + 2 * self.target_layers * self.target_hidden * sum(
            n * n for n in lengths)
        # Useful work only: the padding rows of plan.pad_shapes are not counted.
        rows = plan.teacher_positions.numel() if plan.num_teacher_rows is None else plan.num_teacher_rows
        teacher = 2 * self.target_hidden * self.target_vocab * rows
        elements = sum(len(f.layout) for f in plan.forwards)
        charged = sum(f.charged.numel() if f.num_charged is None else f.num_charged for f in plan.forwards)
        head = (6 if self.head_trained else 4) * self.head_params * charged
        return float(target + teacher + 6 * self.drafter_params * elements + head)
