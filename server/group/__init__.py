"""Serving one model from several hosts, one room: which ids each host needs (``routing``), moving only those ids
and the pooled columns back (``exchange``), the step loop every rank runs and the group's health in it
(``step``), the members and who serves each slot, re-forming after a lost host with replicas (``members``), the
group itself — joining, configuration, failure, the leader-driven protocol (``leader``) — and
``embserve serve`` on one rank (``serve``); ``launch`` starts torchrun with a clean SIGTERM. Each host's front end
is the single-host pipeline of ``server.app``."""
