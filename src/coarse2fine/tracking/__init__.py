"""Experiment tracking: one MLflow run per stage execution, nested under one run per pipeline, plus DVCLive files
for DVC. The only package that imports mlflow and dvclive, one module per job:

- `identity`: what names a pipeline and where its store is (plain Python: no MLflow import, so a stage that
  only needs to know whether anything changed, such as a no-op lineage, starts in a fraction of a second);
- `store`: opening the MLflow store, the experiment and the pipeline run;
- `live`: the DVCLive files dvc.yaml declares as metrics and plots;
- `runs`: `Tracker`, the lifecycle of a stage's run;
- `models`: logging a trained model to MLflow and loading it back;
- `outbox`: the writes a store that went away mid-stage could not take, retried with back-off;
- `lineage`: linking the stages DVC skipped to the runs that made their outputs, and registering the result.

DVCLive writes plain files under the stage's metrics directory:

    <metrics_dir>/metrics.json               latest value of every metric + the summary (`dvc metrics show`)
    <metrics_dir>/plots/metrics/<name>.tsv   one row per logged step (`dvc plots show`)

Only rank 0 tracks; on other ranks every method is a no-op, so callers never branch on the rank.

Pipeline runs. DVC hands its stages no execution id, and each stage is a process of its own. A stage's run is
nested (MLflow's parentRunId) under the pipeline run of what decides its results, `identity.pipeline_identity`:
the code (every file under src/ and stages/, dirty edits included), the whole params file and the data (the
source stage's listings), hashed into `pipeline.key`. Every stage of one `dvc repro`, `dvc repro <stage>`, `make
repro` or `dvc exp run` computes the same key and finds that run (or creates it: under the store's lock for a
sqlite store; against a server, two racing creators both look again and the later run deletes itself). Another
params value or code edit is another pipeline run; reproducing an unchanged pipeline again nests under the same
one. The pipeline run holds every param; it is RUNNING while one of its stages runs and ends as its last stage did.

Lineage. A stage DVC skipped has no run of its own in the new pipeline run. The last stage of the pipeline
(stages/lineage.py, every `dvc repro`) calls `lineage.record_lineage` with dvc.lock: each stage run of this
pipeline is tagged with its outputs' DVC hashes (`dvc.outs`), and each stage without one gets a "<stage> (cached)"
run, tagged `cached_from` = the run whose `dvc.outs` match the outputs DVC kept, with that run's params and metric
histories. The pipeline's result, the model its finetune run (or the run a cached finetune links to) logged, is
registered under params tracking.registered_model: tracking.candidate_alias moves to it, tracking.champion_alias
only if it was trained on the whole data set and beats the champion's top-1 on the same val set. When the
pipeline's key, dvc.lock's outputs and the store are what the last record left, there is nothing to record and
MLflow is not opened.

MLflow is a convenience, DVC's files are the record: if the store cannot be opened (a bad URI, a server that is
down, a read-only database), the stage prints one warning and goes on without MLflow, and its metrics still land in
the DVCLive files. A store that goes away mid-stage (a server restarted) costs one warning: `outbox` keeps the
stage's writes in order and sends them when it is back (retried with back-off; bounded; drained at the end). Against a server, MLflow's HTTP retries are cut to
`mlflow_store.HTTP_RETRIES` (its default, 7 with exponential back-off, waits minutes per call) unless the environment
sets them.
"""
