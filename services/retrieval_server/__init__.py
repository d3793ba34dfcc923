"""retrieval-server: Search-R1's /retrieve over a FAISS (flat, HNSW, IVF-PQ) or BM25 index of passages."""
