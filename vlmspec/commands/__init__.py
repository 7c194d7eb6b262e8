"""The subcommands of ``vlmspec`` (:mod:`vlmspec.cli` assembles them), one module per group of commands.

* :mod:`~vlmspec.commands.generate`: ``generate`` and ``demo``
* :mod:`~vlmspec.commands.serve`: ``serve``
* :mod:`~vlmspec.commands.sps`: ``profile`` and ``simulate``
* :mod:`~vlmspec.commands.export`: ``export``
* :mod:`~vlmspec.commands.options`: what they share (option groups, help texts, building the engine)

Each module's ``add_*`` functions add a subparser whose ``run`` default is the command itself.
"""
