"""keel's command-line tools: each runs as `python tools/NAME.py` from a checkout, and installs as
a console command (setup.cfg [options.entry_points]: keel-compile, keel-run, ...)."""
