from specjax.cli import entry

entry()
