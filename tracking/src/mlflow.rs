//! An MLflow tracking server through its REST API (`/api/2.0/mlflow/...`), at
//! `$MLFLOW_TRACKING_URI` (http or https), as VeRL's `mlflow` logger uses it:
//! `trainer.project_name` is the experiment (created if missing), `trainer.experiment_name`
//! the run's name, the recipe the run's parameters (flattened with `/`), each step's metrics
//! one `log-batch`. `$MLFLOW_RUN_ID` attaches to an existing run instead; a resumed run
//! continues its own (`OUTPUT/tracking.json`). Credentials: `$MLFLOW_TRACKING_TOKEN` (bearer)
//! or `$MLFLOW_TRACKING_USERNAME` / `$MLFLOW_TRACKING_PASSWORD` (basic).
//!
//! Metric names keep MLflow's character set as VeRL's adapter keeps it: `@` becomes `_at_`,
//! repeated slashes one, anything else outside `[/\w.\- :]` an underscore.

use crate::{flatten, Generation, Logger, Metrics, RunIds, Sink, TrackingConfig};
use serde_json::{json, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// MLflow's limits per `log-batch` request.
const METRICS_PER_BATCH: usize = 1000;
const PARAMS_PER_BATCH: usize = 100;
const PARAM_VALUE_CHARS: usize = 6000;

/// The server's address from `$MLFLOW_TRACKING_URI`, or what to set.
pub fn tracking_uri(config: &TrackingConfig) -> Result<String, String> {
    match config.var("MLFLOW_TRACKING_URI") {
        Some(uri) if uri.starts_with("http://") || uri.starts_with("https://") => {
            Ok(uri.trim_end_matches('/').to_string())
        }
        Some(uri) => Err(format!(
            "MLFLOW_TRACKING_URI is {uri:?}; the `mlflow` logger talks to a tracking server over \
             its REST API and needs an http:// or https:// address (start one with `mlflow server \
             --backend-store-uri {uri}` and point MLFLOW_TRACKING_URI at it)"
        )),
        None => Err(
            "the `mlflow` logger needs MLFLOW_TRACKING_URI, the http:// or https:// address \
                     of a tracking server (for example `mlflow server --port 5000` and \
                     MLFLOW_TRACKING_URI=http://127.0.0.1:5000)"
                .into(),
        ),
    }
}

/// A metric name as MLflow accepts it (VeRL's sanitising).
pub fn metric_key(name: &str) -> String {
    let replaced = name.replace('@', "_at_");
    let mut out = String::with_capacity(replaced.len());
    for c in replaced.chars() {
        let c = if c.is_alphanumeric() || "_/.- :".contains(c) {
            c
        } else {
            '_'
        };
        if c == '/' && out.ends_with('/') {
            continue;
        }
        out.push(c);
    }
    out
}

/// A double as protobuf's JSON mapping writes it (non-finite values as strings).
fn double(v: f64) -> Value {
    if v.is_nan() {
        json!("NaN")
    } else if v == f64::INFINITY {
        json!("Infinity")
    } else if v == f64::NEG_INFINITY {
        json!("-Infinity")
    } else {
        json!(v)
    }
}

fn millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The MLflow logger of a run.
pub struct Mlflow {
    uri: String,
    auth: Option<String>,
    agent: ureq::Agent,
    run_id: String,
    /// Where the run's artifacts go (`mlflow-artifacts:/...` through the server, or a path).
    artifact_uri: String,
}

impl Mlflow {
    pub fn start(config: &TrackingConfig, ids: &mut RunIds) -> Result<Mlflow, String> {
        let uri = tracking_uri(config)?;
        let auth = if let Some(token) = config.var("MLFLOW_TRACKING_TOKEN") {
            Some(format!("Bearer {token}"))
        } else {
            config.var("MLFLOW_TRACKING_USERNAME").map(|user| {
                let password = config.var("MLFLOW_TRACKING_PASSWORD").unwrap_or("");
                {
                    use base64::Engine;
                    let credentials = format!("{user}:{password}");
                    format!(
                        "Basic {}",
                        base64::engine::general_purpose::STANDARD.encode(credentials)
                    )
                }
            })
        };
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(15)))
            .build()
            .into();
        let mut mlflow = Mlflow {
            uri,
            auth,
            agent,
            run_id: String::new(),
            artifact_uri: String::new(),
        };
        let attach = config
            .var("MLFLOW_RUN_ID")
            .map(str::to_string)
            .or_else(|| ids.mlflow_run_id.clone().filter(|_| config.resume));
        let resumed = match attach {
            Some(run_id) => match mlflow.get("runs/get", &[("run_id", &run_id)])? {
                Some(found) => {
                    mlflow.run_id = run_id;
                    mlflow.artifact_uri = found["run"]["info"]["artifact_uri"]
                        .as_str()
                        .unwrap_or_default()
                        .into();
                    mlflow.post(
                        "runs/update",
                        json!({"run_id": mlflow.run_id, "status": "RUNNING"}),
                    )?;
                    true
                }
                None if config.var("MLFLOW_RUN_ID").is_some() => {
                    return Err(format!("MLFLOW_RUN_ID {run_id} is not a run of {}", mlflow.uri))
                }
                None => false,
            },
            None => false,
        };
        if !resumed {
            let experiment_id = mlflow.experiment(&config.project)?;
            let answer = mlflow.post(
                "runs/create",
                json!({
                    "experiment_id": experiment_id,
                    "run_name": config.experiment,
                    "start_time": millis(),
                    "tags": [
                        {"key": "mlflow.runName", "value": config.experiment},
                        {"key": "mlflow.source.name", "value": "grpo"},
                    ],
                }),
            )?;
            mlflow.run_id = answer["run"]["info"]["run_id"]
                .as_str()
                .ok_or_else(|| format!("runs/create answered without a run id: {answer}"))?
                .to_string();
            mlflow.artifact_uri = answer["run"]["info"]["artifact_uri"]
                .as_str()
                .unwrap_or_default()
                .into();
            mlflow.log_params(&config.params)?;
        }
        ids.mlflow_run_id = Some(mlflow.run_id.clone());
        Ok(mlflow)
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The id of the experiment named `name`, created if missing.
    fn experiment(&self, name: &str) -> Result<String, String> {
        for _ in 0..2 {
            if let Some(found) = self.get("experiments/get-by-name", &[("experiment_name", name)])? {
                if let Some(id) = found["experiment"]["experiment_id"].as_str() {
                    return Ok(id.to_string());
                }
            }
            match self.post("experiments/create", json!({ "name": name })) {
                Ok(created) => {
                    if let Some(id) = created["experiment_id"].as_str() {
                        return Ok(id.to_string());
                    }
                }
                // Another run created it meanwhile: look it up again.
                Err(error) if error.contains("RESOURCE_ALREADY_EXISTS") => continue,
                Err(error) => return Err(error),
            }
        }
        Err(format!("cannot find or create the MLflow experiment {name:?}"))
    }

    fn log_params(&self, params: &Value) -> Result<(), String> {
        let params: Vec<Value> = flatten(params)
            .into_iter()
            .map(|(key, value)| {
                let value: String = value.chars().take(PARAM_VALUE_CHARS).collect();
                json!({ "key": metric_key(&key), "value": value })
            })
            .collect();
        for chunk in params.chunks(PARAMS_PER_BATCH) {
            self.post(
                "runs/log-batch",
                json!({ "run_id": self.run_id, "params": chunk }),
            )?;
        }
        Ok(())
    }

    fn url(&self, method: &str) -> String {
        format!("{}/api/2.0/mlflow/{method}", self.uri)
    }

    /// GET `method`; `None` when the server says the resource does not exist.
    fn get(&self, method: &str, query: &[(&str, &str)]) -> Result<Option<Value>, String> {
        let mut request = self.agent.get(&self.url(method));
        for (k, v) in query {
            request = request.query(*k, *v);
        }
        if let Some(auth) = &self.auth {
            request = request.header("authorization", auth);
        }
        let response = request
            .call()
            .map_err(|e| format!("GET {}: {e}", self.url(method)))?;
        self.answer(method, response)
    }

    /// Stores `bytes` as the run's artifact `name`: through the server's artifact proxy
    /// (`mlflow-artifacts:` URIs), or into the artifact directory when the store is a path on
    /// this machine, as MLflow's client does.
    fn put_artifact(&self, name: &str, bytes: &[u8]) -> Result<(), String> {
        let uri = &self.artifact_uri;
        if let Some(rest) = uri.strip_prefix("mlflow-artifacts:") {
            // `mlflow-artifacts:/path` or `mlflow-artifacts://host:port/path`.
            let path = match rest.strip_prefix("//") {
                Some(authority) => authority.split_once('/').map_or("", |(_, p)| p),
                None => rest.trim_start_matches('/'),
            };
            let url = format!("{}/api/2.0/mlflow-artifacts/artifacts/{path}/{name}", self.uri);
            let mut request = self.agent.put(&url);
            if let Some(auth) = &self.auth {
                request = request.header("authorization", auth);
            }
            let response = request.send(bytes).map_err(|e| format!("PUT {url}: {e}"))?;
            return self.answer("mlflow-artifacts", response).map(|_| ());
        }
        let dir = uri.strip_prefix("file://").unwrap_or(uri);
        if !dir.starts_with('/') {
            return Err(format!(
                "the run's artifacts go to {uri}, which only MLflow's own client writes; serve them \
                 through the tracking server (`mlflow server --artifacts-destination {uri}`)"
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {dir}: {e}"))?;
        let path = std::path::Path::new(dir).join(name);
        std::fs::write(&path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
    }

    fn post(&self, method: &str, body: Value) -> Result<Value, String> {
        let mut request = self
            .agent
            .post(&self.url(method))
            .header("content-type", "application/json");
        if let Some(auth) = &self.auth {
            request = request.header("authorization", auth);
        }
        let response = request
            .send(body.to_string().as_bytes())
            .map_err(|e| format!("POST {}: {e}", self.url(method)))?;
        self.answer(method, response)?
            .ok_or_else(|| format!("POST {}: not found", self.url(method)))
    }

    fn answer(
        &self,
        method: &str,
        mut response: ureq::http::Response<ureq::Body>,
    ) -> Result<Option<Value>, String> {
        let status = response.status();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| format!("{}: reading the answer: {e}", self.url(method)))?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
        if status.is_success() {
            return Ok(Some(value));
        }
        if status.as_u16() == 404 || value["error_code"] == "RESOURCE_DOES_NOT_EXIST" {
            return Ok(None);
        }
        let text: String = text.chars().take(300).collect();
        Err(format!("{} answered HTTP {status}: {text}", self.url(method)))
    }
}

impl Sink for Mlflow {
    fn logger(&self) -> Logger {
        Logger::Mlflow
    }

    fn log(&mut self, step: u64, metrics: &Metrics) -> Result<(), String> {
        let timestamp = millis();
        let metrics: Vec<Value> = metrics
            .iter()
            .map(|(name, v)| {
                json!({ "key": metric_key(name), "value": double(*v), "timestamp": timestamp, "step": step })
            })
            .collect();
        for chunk in metrics.chunks(METRICS_PER_BATCH) {
            self.post(
                "runs/log-batch",
                json!({ "run_id": self.run_id, "metrics": chunk }),
            )?;
        }
        Ok(())
    }

    /// VeRL's artifact `val_step{step}.json`: `[{"input", "output", "score"}, ...]`.
    fn log_generations(&mut self, step: u64, generations: &[Generation]) -> Result<(), String> {
        let json = serde_json::to_vec(generations).expect("serialisable");
        self.put_artifact(&format!("val_step{step}.json"), &json)
    }

    fn finish(&mut self, ok: bool) -> Result<(), String> {
        let status = if ok { "FINISHED" } else { "FAILED" };
        self.post(
            "runs/update",
            json!({ "run_id": self.run_id, "status": status, "end_time": millis() }),
        )
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_are_sanitised_as_verl_does() {
        assert_eq!(
            metric_key("val-core/gsm8k/acc/mean@4"),
            "val-core/gsm8k/acc/mean_at_4"
        );
        assert_eq!(metric_key("a//b(c)"), "a/b_c_");
        assert_eq!(metric_key("critic/score/mean"), "critic/score/mean");
    }

    #[test]
    fn non_finite_values_use_protobuf_json_strings() {
        assert_eq!(double(f64::NAN), json!("NaN"));
        assert_eq!(double(f64::NEG_INFINITY), json!("-Infinity"));
        assert_eq!(double(0.5), json!(0.5));
    }
}
