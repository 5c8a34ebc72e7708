"""Reference models shared by the demo, the TP parallelize plans and pipeline splitting."""

from overlap.models.gpt import (GPT, MLP, Block, CausalSelfAttention, GPTConfig, GPTEmbedding,
                                GPTHead, gpt_loss, pipeline_piece_costs)

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "GPTEmbedding", "GPTHead",
           "gpt_loss", "pipeline_piece_costs"]
