//! Logging and telemetry setup.
//!
//! `tracing` to stderr, filtered by `RUST_LOG` (default `info` for
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
use std::io::IsTerminal;
use std::sync::atomic::Ordering::Relaxed;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Flushes and stops the exporters when dropped.
pub struct Guard {
    tracer: Option<SdkTracerProvider>,
    meter: Option<SdkMeterProvider>,
}

impl Drop for Guard {
    fn drop(&mut self) {
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
pub fn init(long_running: bool) -> Guard {
    let default = if long_running { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").unwrap_or_default();
    if endpoint.trim().is_empty() {
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(fmt())
            .try_init();
        return Guard {
            tracer: None,
            meter: None,
        };
    }
    match otlp() {
        Ok((tracer, meter)) => {
            let layer = tracing_opentelemetry::layer().with_tracer(tracer.tracer("strata"));
            // Spans are exported at info and above whatever RUST_LOG says
            // for the console.
            let _ = tracing_subscriber::registry()
                .with(fmt().with_filter(filter))
                .with(layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO))
                .try_init();
            register(&meter.meter("strata"));
            Guard {
                tracer: Some(tracer),
                meter: Some(meter),
            }
        }
        Err(e) => {
            let _ = tracing_subscriber::registry()
                .with(filter)
                .with(fmt())
                .try_init();
            tracing::error!(error = %e, endpoint, "OTLP export is off: could not set up the exporter");
            Guard {
                tracer: None,
                meter: None,
            }
        }
    }
}

use tracing_subscriber::Layer as _;

/// Human-readable logs on stderr, coloured only on a terminal.
fn fmt<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
}

fn otlp() -> Result<(SdkTracerProvider, SdkMeterProvider), Box<dyn std::error::Error>> {
    let resource = Resource::builder().with_service_name("strata").build();
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

/// The process's metrics as OpenTelemetry instruments, read from the same
/// registry the Prometheus endpoint renders.
fn register(meter: &Meter) {
    let counter =
        |name: &'static str, unit: &'static str, description: &'static str, read: fn() -> u64| {
            meter
                .u64_observable_counter(name)
                .with_unit(unit)
                .with_description(description)
                .with_callback(move |o| o.observe(read(), &[]))
                .build();
        };
    counter(
        "strata.append.events",
        "{event}",
        "Events appended and committed",
        || events::metrics::global().append_events.load(Relaxed),
    );
    counter(
        "strata.append.in_events",
        "{event}",
        "Events written inside callers' own transactions (counted when written)",
        || events::metrics::global().append_in_events.load(Relaxed),
    );
    counter(
        "strata.append.transactions",
        "{transaction}",
        "Group-commit transactions committed",
        || events::metrics::global().append_transactions.load(Relaxed),
    );
    counter(
        "strata.append.conflicts",
        "{append}",
        "Appends refused for a version conflict",
        || events::metrics::global().append_conflicts.load(Relaxed),
    );
    counter(
        "strata.replication.events",
        "{event}",
        "Events decoded from the replication stream",
        || events::metrics::global().replication_events.load(Relaxed),
    );
    meter
        .f64_observable_gauge("strata.replication.lag")
        .with_unit("By")
        .with_description("WAL between the server's position and what this process acknowledged")
        .with_callback(|o| o.observe(events::metrics::global().replication_lag_bytes.get(), &[]))
        .build();
    meter
        .f64_observable_gauge("strata.replication.lag.time")
        .with_unit("s")
        .with_description("Age of the newest transaction received, at receipt")
        .with_callback(|o| o.observe(events::metrics::global().replication_lag_seconds.get(), &[]))
        .build();
    meter
        .u64_observable_gauge("strata.subscription.lag")
        .with_unit("{event}")
        .with_description("Events committed but not yet acknowledged, per subscription")
        .with_callback(|o| {
            for (name, lag) in events::metrics::global().subscription_lags() {
                o.observe(lag.events, &[KeyValue::new("subscription", name)]);
            }
        })
        .build();
    meter
        .f64_observable_gauge("strata.subscription.lag.time")
        .with_unit("s")
        .with_description("Age of the newest event delivered, per subscription")
        .with_callback(|o| {
            for (name, lag) in events::metrics::global().subscription_lags() {
                o.observe(lag.seconds, &[KeyValue::new("subscription", name)]);
            }
        })
        .build();
}
