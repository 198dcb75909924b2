"""embserve.v1: the service (``service``) and its request codec (``codec``, shared with ``server.client``)."""
