"""One module per ``embserve`` subcommand (its ``cmd_*`` and ``add_parser``), and the helpers they share;
``infer.cli`` assembles the parser from them."""
