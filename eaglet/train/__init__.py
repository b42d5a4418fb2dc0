"""The training stage: speculators trains the draft (its model, Trainer and CLI config), eaglet launches it and
chooses what it delivers.

- launch: speculators' argv for a run, in this process or one rank per GPU under torchrun (rank)
- cpu, ttt_attention: the smallest patches that let speculators train on a CPU
- metrics: speculators' logged metrics, recorded and followed; progress from them
- checkpoints: whole epochs, the best one by simulated acceptance, the delivered draft
- acceptance: decoding simulated on the validation rows (what vLLM should measure)
- warm_start: which stored draft a run may continue, and every draft's lineage
- draft: the stage itself, top to bottom
"""

from eaglet.train.checkpoints import (best_checkpoint, checkpoint_problem, discard_incomplete_checkpoints,
                                      last_checkpoint, read_delivered, write_delivered, write_final_draft)
from eaglet.train.launch import (BF16_MIN_SPEEDUP, bf16_matmul_speedup, cpu_dtype, speculators_argv,
                                 train_draft)
from eaglet.train.metrics import METRICS_FILE, read_metrics, simulated_acceptance
from eaglet.train.warm_start import (check_init_dir, find_previous, read_lineage, warm_start_decision,
                                     warm_start_weights, write_lineage)

__all__ = ["BF16_MIN_SPEEDUP", "METRICS_FILE", "best_checkpoint", "bf16_matmul_speedup", "check_init_dir",
           "checkpoint_problem", "cpu_dtype", "discard_incomplete_checkpoints", "find_previous", "last_checkpoint",
           "read_delivered", "read_lineage", "read_metrics", "simulated_acceptance", "speculators_argv",
           "train_draft", "warm_start_decision", "warm_start_weights", "write_delivered", "write_final_draft",
           "write_lineage"]
