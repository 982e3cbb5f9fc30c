"""The runner: starts the ranks, plans and budgets the run, times and checks each case,
and writes the results, the figures and the report. It finds the families in
bench/families/ (family.py); what it knows by name is the rows' bench column (rows.py),
which the targets, the figures and the headline read."""
