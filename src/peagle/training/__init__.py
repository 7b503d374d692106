"""Drafter training: response regeneration, COD sampling, the P-EAGLE attention mask, the sequence partition,
the trainer (P-EAGLE and EAGLE-3) and their command lines (`peagle regenerate`, `peagle train`).

Data flow of one step: packed sequence (data) -> frozen target pass (teacher) -> training elements (cod) ->
drafter forward through a FlexAttention block mask (forward, mask, attention), per segment (partition) ->
chunked KL loss (loss) -> backward; the loop, schedules, logs and checkpoints live in trainer.
"""
