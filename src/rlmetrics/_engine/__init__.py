"""The engine: private, organised by the stages a logged value passes through.

    record   record.py, inputs.py        a log call's checks; the step's records
    fold     fold.py, fold_plan.py,      records -> one batch per device -> each kind's
             assemble.py                 reduce -> one state row per metric
    table    table.py                    the rows: host (numpy) and device halves
    pack     layout.py, packing.py,      the table into one SUM and one MAX buffer; the
             results.py                  reduced buffers back into results
    sync     sync.py, collectives.py,    one collective per step; the schema the ranks
             group_layouts.py            agreed on; collectives that time out
    plan     plan.py                     StepPlan: every cache a tracker keeps between
                                         steps, with one invalidation rule

Nothing here is imported by users: the public names are in ``rlmetrics`` and its
public modules (see docs/architecture.md).
"""
