"""The engine: private, organised by the stages a logged value passes through.

    record   record.py (inputs.py)       a log call's checks; the step's records
    fold     fold.py (assemble.py)       records -> one batch per device -> each kind's
                                         reduce -> one state row per metric; assemble
                                         joins the records into flat arrays
    table    table.py                    the rows: host (numpy) and device halves
    pack     packing.py (layout.py)      the table into one SUM and one MAX buffer; the
                                         reduced buffers back into results
    sync     sync.py (schema.py)         one collective per step, collectives that time
                                         out; the schema the ranks agree on
    plan     plan.py                     StepPlan: every cache a tracker keeps between
                                         steps, with one invalidation rule, and the
                                         host fold's reusable buffers

Nothing here is imported by users: the public names are in ``rlmetrics`` and its
public modules (see docs/architecture.md).
"""
