"""This host's side of a node: the per-user runtime directory, the node secret, and process facts from /proc."""
