"""The training stage: speculators trains the draft (its model, Trainer and CLI config), eaglet launches it and
chooses what it delivers. Training is given its draft architecture (eaglet.drafts.base) and never names one.

- launch: speculators' argv for a run, in this process or one rank per GPU under torchrun (rank)
- cpu, ttt_attention: the smallest patches that let speculators train on a CPU
- metrics: speculators' logged metrics, recorded and followed; progress from them
- checkpoints: whole epochs, the best one by the architecture's score, the delivered draft
- warm_start: which stored draft a run may continue; lineage: what every draft and its ancestors saw; replay: what a
  warm start trains on
- stream: streamed states from the capture engine (speculators' online path)
- vocab: the draft vocabulary (d2t / t2d)
- draft: the stage itself, top to bottom
"""
