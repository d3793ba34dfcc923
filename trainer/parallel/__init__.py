"""The Ray / FSDP2 machinery: role groups of ranks (in this process or in Ray actors), process groups,
sharding and weight sync; the only place that knows how many ranks there are."""
