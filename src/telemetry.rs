//! Logging and telemetry setup.
//!
//! `tracing` to stderr (or to a file, as `strata dev` asks, so its status
//! report keeps the terminal), filtered by `RUST_LOG` (default `info` for
//! long-running commands, `warn` for one-shot ones). When
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, spans and metrics are also exported
//! over OTLP/gRPC; the standard `OTEL_*` variables (service name, resource
//! attributes, export interval) apply. The returned guard flushes both on
//! drop, so even a one-shot command exports what it recorded.

use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use ops::metrics::prometheus::proto::{Metric, MetricFamily, MetricType};
use std::collections::HashSet;
use std::io::IsTerminal;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Flushes and stops the exporters when dropped.
pub struct Guard {
    tracer: Option<SdkTracerProvider>,
    meter: Option<SdkMeterProvider>,
    bridge: Option<Arc<Bridge>>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(b) = &self.bridge {
            b.sync();
        }
        if let Some(t) = self.tracer.take() {
            if let Err(e) = t.shutdown() {
                eprintln!("warning: flush spans over OTLP: {e}");
            }
        }
        if let Some(m) = self.meter.take() {
            if let Err(e) = m.shutdown() {
                eprintln!("warning: flush metrics over OTLP: {e}");
            }
        }
    }
}

/// Sets up logging, and OTLP export when configured. Must be called inside a
/// Tokio runtime context: the gRPC exporter runs on it.
pub fn init(long_running: bool, log_file: Option<&std::path::Path>) -> Guard {
    let writer = match log_file.map(open_log) {
        Some(Ok(file)) => Some(file),
        Some(Err(e)) => {
            eprintln!("warning: {e}; logging to the terminal");
            None
        }
        None => None,
    };
    let file = || writer.as_ref().and_then(|f| f.try_clone().ok());
    let default = if long_running { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").unwrap_or_default();
    if endpoint.trim().is_empty() {
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(fmt(file()))
            .try_init();
        return Guard {
            tracer: None,
            meter: None,
            bridge: None,
        };
    }
    match otlp() {
        Ok((tracer, meter)) => {
            let layer = tracing_opentelemetry::layer().with_tracer(tracer.tracer("strata"));
            // Spans are exported at info and above whatever RUST_LOG says
            // for the console.
            let _ = tracing_subscriber::registry()
                .with(fmt(file()).with_filter(filter))
                .with(layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO))
                .try_init();
            // Trace context travels in event metadata (events::trace).
            events::trace::install(events::trace::Hooks {
                current: current_traceparent,
                follow: follow_traceparent,
            });
            // The log's own families exist before any role starts.
            events::metrics::global();
            let bridge = Arc::new(Bridge {
                meter: meter.meter("strata"),
                known: Mutex::default(),
            });
            bridge.sync();
            let b = bridge.clone();
            ops::task::spawn("otlp-metrics", async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    b.sync();
                }
            });
            Guard {
                tracer: Some(tracer),
                meter: Some(meter),
                bridge: Some(bridge),
            }
        }
        Err(e) => {
            let _ = tracing_subscriber::registry()
                .with(filter)
                .with(fmt(file()))
                .try_init();
            tracing::error!(error = %e, endpoint, "OTLP export is off: could not set up the exporter");
            Guard {
                tracer: None,
                meter: None,
                bridge: None,
            }
        }
    }
}

use tracing_subscriber::Layer as _;

/// The W3C `traceparent` of the current `tracing` span, as OpenTelemetry
/// has it.
fn current_traceparent() -> Option<String> {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// Makes `span` a child of the remote span `traceparent` names (checked by
/// `events::trace::follow` before this is called).
fn follow_traceparent(span: &tracing::Span, traceparent: &str) {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let parts: Vec<&str> = traceparent.split('-').collect();
    let (Ok(trace), Ok(id), Ok(flags)) = (
        TraceId::from_hex(parts[1]),
        SpanId::from_hex(parts[2]),
        u8::from_str_radix(parts[3], 16),
    ) else {
        return;
    };
    let sc = SpanContext::new(
        trace,
        id,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
}

/// Human-readable logs on stderr, coloured only on a terminal, or into
/// `file`.
fn fmt<S>(file: Option<std::fs::File>) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    let ansi = file.is_none() && std::io::stderr().is_terminal();
    let writer = match file {
        Some(f) => BoxMakeWriter::new(Mutex::new(f)),
        None => BoxMakeWriter::new(std::io::stderr),
    };
    tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_target(false)
        .with_ansi(ansi)
}

/// The log file, appended to (its folder made if need be).
fn open_log(path: &std::path::Path) -> Result<std::fs::File, String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("open the log file {}: {e}", path.display()))
}

/// Whether the environment names the service.
fn resource_has_name() -> bool {
    let set = |v: &str| std::env::var(v).is_ok_and(|s| !s.trim().is_empty());
    set("OTEL_SERVICE_NAME")
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| {
            a.split(',')
                .any(|kv| kv.split('=').next().map(str::trim) == Some("service.name"))
        })
}

fn otlp() -> Result<(SdkTracerProvider, SdkMeterProvider), Box<dyn std::error::Error>> {
    // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are read by the
    // builder's detectors; without either, the service is `strata`.
    let mut resource = Resource::builder();
    let named = resource_has_name();
    if !named {
        resource = resource.with_service_name("strata");
    }
    let resource = resource.build();
    let spans = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let tracer = SdkTracerProvider::builder()
        .with_batch_exporter(spans)
        .with_resource(resource.clone())
        .build();
    let metrics = opentelemetry_otlp::MetricExporter::builder()
        .with_tonic()
        .build()?;
    let meter = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(metrics).build())
        .with_resource(resource)
        .build();
    Ok((tracer, meter))
}

/// The OTLP side of the process's one metrics registry: each family of
/// [`ops::metrics::gather`] becomes an observable instrument read from the
/// registry at each export, so OTLP carries every series `/metrics` does.
/// Families are looked for at start, every few seconds after (roles register
/// theirs as they start) and once more before the final flush. Names are the
/// Prometheus names with `_` as `.` and without `_total`; a histogram is sent
/// as its `.count` and `.sum` (OpenTelemetry has no observable histogram).
struct Bridge {
    meter: Meter,
    known: Mutex<HashSet<String>>,
}

/// The registry's families, read at most once a second however many
/// instruments ask.
fn families() -> Arc<Vec<MetricFamily>> {
    type Read = Option<(Instant, Arc<Vec<MetricFamily>>)>;
    static CACHE: OnceLock<Mutex<Read>> = OnceLock::new();
    let mut c = CACHE
        .get_or_init(Mutex::default)
        .lock()
        .expect("families cache");
    match &*c {
        Some((at, f)) if at.elapsed() < Duration::from_secs(1) => f.clone(),
        _ => {
            let f = Arc::new(ops::metrics::gather());
            *c = Some((Instant::now(), f.clone()));
            f
        }
    }
}

/// The series of family `name`: label pairs and the metric.
fn series(name: &str, mut each: impl FnMut(Vec<KeyValue>, &Metric)) {
    if let Some(f) = families().iter().find(|f| f.name() == name) {
        for m in f.get_metric() {
            let attrs = m
                .get_label()
                .iter()
                .map(|l| KeyValue::new(l.name().to_string(), l.value().to_string()))
                .collect();
            each(attrs, m);
        }
    }
}

fn otel_name(prometheus: &str) -> String {
    prometheus
        .strip_suffix("_total")
        .unwrap_or(prometheus)
        .replace('_', ".")
}

impl Bridge {
    /// Adds an instrument for every family not seen before.
    fn sync(&self) {
        let mut known = self.known.lock().expect("bridge lock");
        for f in ops::metrics::gather() {
            let name = f.name().to_string();
            if !known.insert(name.clone()) {
                continue;
            }
            let otel = otel_name(&name);
            let help = f.help().to_string();
            match f.get_field_type() {
                MetricType::COUNTER => {
                    self.meter
                        .f64_observable_counter(otel)
                        .with_description(help)
                        .with_callback(move |o| {
                            series(&name, |a, m| o.observe(m.get_counter().get_value(), &a))
                        })
                        .build();
                }
                MetricType::GAUGE => {
                    self.meter
                        .f64_observable_gauge(otel)
                        .with_description(help)
                        .with_callback(move |o| {
                            series(&name, |a, m| o.observe(m.get_gauge().get_value(), &a))
                        })
                        .build();
                }
                MetricType::HISTOGRAM => {
                    let n = name.clone();
                    self.meter
                        .u64_observable_counter(format!("{otel}.count"))
                        .with_description(help.clone())
                        .with_callback(move |o| {
                            series(&n, |a, m| {
                                o.observe(m.get_histogram().get_sample_count(), &a)
                            })
                        })
                        .build();
                    self.meter
                        .f64_observable_counter(format!("{otel}.sum"))
                        .with_description(help)
                        .with_callback(move |o| {
                            series(&name, |a, m| {
                                o.observe(m.get_histogram().get_sample_sum(), &a)
                            })
                        })
                        .build();
                }
                _ => {}
            }
        }
    }
}
