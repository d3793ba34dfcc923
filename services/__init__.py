"""CPU services of the job group: data-server, reward-server, retrieval-server."""
