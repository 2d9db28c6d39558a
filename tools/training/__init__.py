"""What a training run shows on a terminal (`expertctl expert train`, `make experts`); the training
itself is libs.training."""
