"""Training experts: JSONL samples rendered as the engine serves them, a PEFT adapter trained with
`peft` and `transformers` on them (`expertctl expert train`)."""
