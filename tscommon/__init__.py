"""What the agent (`containerboot`), the serve path (`serveconfig`) and the controller (`controller`) share.

Nothing here imports from those packages: shared pieces sit below the packages that use them.
"""
