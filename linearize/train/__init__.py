"""Training: one stage loop (:mod:`.loop`) run by attention transfer (:mod:`.distill`) and LoRA
(:mod:`.finetune`), with its guards (:mod:`.guards`) and memory plan (:mod:`.memory`).

Nothing is imported here: ``linearize.train.guards`` (out-of-memory messages, used by every command) loads
without the training stages.
"""
