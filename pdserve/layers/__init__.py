"""Model building blocks: TP-shardable linears, norms, rotary embeddings, paged attention, sampling."""
