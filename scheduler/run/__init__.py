"""The running job: the driver and its conversation with the clusters (channel), leases,
recovery of lost clusters, checkpoints, the bridge mesh, and the learning watch."""
