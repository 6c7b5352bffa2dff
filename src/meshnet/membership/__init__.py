"""Membership you can trust: each node proves who it is with an Ed25519 key pair.

:mod:`meshnet.membership.identity` holds a node's key (generated on first start, kept on disk) and signs
its tracker messages; :mod:`meshnet.membership.auth` is the tracker's side, which refuses a message whose
signature, key or timestamp does not hold up.
"""
