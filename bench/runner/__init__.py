"""The runner: starts the ranks, plans and budgets the run, times and checks each case,
and writes the results, the figures and the report; knows no family by name."""
