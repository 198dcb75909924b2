"""Serving one model from several hosts: which ids each host needs (routing), moving only those ids and the
pooled columns back (exchange). ``server.distributed`` runs the group's step loop and health on them."""
