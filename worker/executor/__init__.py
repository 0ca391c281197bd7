"""The cluster executor: runs one cluster's share of a federated job.

It is a Ray driver (or an in-process one for tests) that materializes the cluster's
VirtualNodes, trains them, and exchanges model messages with its neighbours: by object
reference inside the cluster, through fabricd's bridge to other clusters. See
`worker.executor.service` for the control messages it answers.
"""
