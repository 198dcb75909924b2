"""The scriptable modules of a served model: the TBE (``tbe``), the unsharded collection and the
exported wrapper (``collection``), and the sharded collection (``sharded``)."""
