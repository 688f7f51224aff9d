"""The node agent: registers its node, runs one stock torchrun per assigned job generation."""
