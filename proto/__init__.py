"""The wire contract of fedpilot-fabric: IDs, messages, codec, streams, bridge, certificates.

Imports nothing from fabricd, worker or scheduler, and never libp2p, torch or ray. The
errors for bad input (`ProtocolError` and its subclasses) are in `proto.errors`.
"""
