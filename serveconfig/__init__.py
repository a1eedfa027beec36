"""serveconfig: the L7 serve config model and its LocalAPI apply (the file watch is tscommon.watch)."""
