"""Planning: from label histograms and cluster slots to a routing matrix — topology,
communities, placement, pinned data. Pure: no I/O, no sockets, no torch, Ray or libp2p
(`fedpilot-scheduler plan` loads only this)."""
