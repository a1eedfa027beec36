"""serveconfig: the L7 serve config model, file watch and LocalAPI apply."""
