"""Training experts: data formats and stored training files, samples rendered as the engine serves
them, a PEFT adapter trained with `peft` and `transformers` on them, packed and signed; training jobs
and their store. Shared by reception (which validates uploads and admits jobs), the trainer worker
and `expertctl expert train`."""
