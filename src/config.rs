//! `strata serve --config FILE`: a TOML file holding any of `serve`'s flags,
//! and `strata config check FILE`, which validates one.
//!
//! A key is a flag's long name, with `_` or `-` (`metrics_listen` or
//! `metrics-listen`); a value is a string, a number, a boolean (a switch) or
//! an array (a comma-separated list). The file is read before the command
//! line is parsed and turned into flags, so clap checks its values exactly
//! as it checks typed ones. What a flag or a `STRATA_*` variable says wins
//! over the file: a key whose flag is on the command line, or whose variable
//! is set, is left out.

use clap::Subcommand;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;
use std::path::PathBuf;

use clap::CommandFactory;

/// The subcommand a file configures.
const SERVE: &str = "serve";

/// Where each effective setting came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    File,
    Env,
    Default,
}

impl Source {
    fn as_str(self) -> &'static str {
        match self {
            Source::File => "file",
            Source::Env => "env",
            Source::Default => "default",
        }
    }
}

/// The file `--config` names on a `serve` command line (or `STRATA_CONFIG`).
fn config_path(argv: &[OsString]) -> Option<OsString> {
    if argv.get(1).map(|a| a.as_os_str()) != Some(SERVE.as_ref()) {
        return None;
    }
    let mut args = argv[2..].iter();
    while let Some(a) = args.next() {
        let Some(s) = a.to_str() else { continue };
        if s == "--" {
            break;
        }
        if s == "--config" {
            return args.next().cloned();
        }
        if let Some(v) = s.strip_prefix("--config=") {
            return Some(v.into());
        }
    }
    std::env::var_os("STRATA_CONFIG").filter(|v| !v.is_empty())
}

/// The long flags given on a command line (`--name` or `--name=value`).
fn flags_given(args: &[OsString]) -> Vec<String> {
    args.iter()
        .filter_map(|a| a.to_str())
        .take_while(|s| *s != "--")
        .filter_map(|s| s.strip_prefix("--"))
        .map(|s| s.split_once('=').map_or(s, |(k, _)| k).to_string())
        .collect()
}

/// The command line `strata` should parse: `argv` with the settings of the
/// `serve --config` file it names put in front of its own flags. Other
/// command lines come back as they are.
pub fn expand(argv: Vec<OsString>) -> Result<Expanded, String> {
    let Some(path) = config_path(&argv) else {
        return Ok(Expanded { argv, file: None });
    };
    let (flags, used) = file_flags(Path::new(&path), &argv[2..])?;
    let mut out = argv[..2].to_vec();
    out.extend(flags);
    out.extend_from_slice(&argv[2..]);
    Ok(Expanded {
        argv: out,
        file: Some((path.into(), used)),
    })
}

/// A command line with a file's settings in it.
pub struct Expanded {
    pub argv: Vec<OsString>,
    /// The file and the keys taken from it.
    pub file: Option<(std::path::PathBuf, Vec<String>)>,
}

impl Expanded {
    /// Parses the command line; an error in a setting from the file names
    /// the file and the key, any other is clap's own.
    pub fn parse(self) -> Result<crate::Cli, String> {
        use clap::Parser;
        match crate::Cli::try_parse_from(&self.argv) {
            Ok(cli) => Ok(cli),
            Err(e) => {
                let from_file = self.file.as_ref().filter(|(_, used)| {
                    e.kind() == clap::error::ErrorKind::MissingRequiredArgument
                        || matches!(
                            e.get(clap::error::ContextKind::InvalidArg),
                            Some(clap::error::ContextValue::String(flag))
                                if used.iter().any(|k| flag.trim_start_matches("--")
                                    .split([' ', '='])
                                    .next() == Some(k.replace('_', "-").as_str()))
                        )
                });
                match from_file {
                    Some((path, _)) => Err(describe(path, &e)),
                    None => e.exit(),
                }
            }
        }
    }
}

/// The flags a file's settings stand for, and the keys used, leaving out
/// those `given` (the command line) or the environment already set.
fn file_flags(path: &Path, given: &[OsString]) -> Result<(Vec<OsString>, Vec<String>), String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("read {shown}: {e}"))?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| format!("{shown}: {e}"))?;
    let cmd = crate::Cli::command();
    let serve = cmd.find_subcommand(SERVE).expect("serve is a subcommand");
    let given = flags_given(given);
    let mut flags = Vec::new();
    let mut used = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let Some(arg) = serve
            .get_arguments()
            .find(|a| a.get_long() == Some(long.as_str()))
            .filter(|_| long != "config" && long != "help" && long != "version")
        else {
            let mut known: Vec<_> = serve
                .get_arguments()
                .filter_map(|a| a.get_long())
                .filter(|l| !["config", "help", "version"].contains(l))
                .map(|l| l.replace('-', "_"))
                .collect();
            known.sort();
            return Err(format!(
                "{shown}: unknown setting `{key}`; serve's settings are: {}",
                known.join(", ")
            ));
        };
        if given.contains(&long) {
            continue;
        }
        if arg
            .get_env()
            .is_some_and(|env| std::env::var_os(env).is_some_and(|v| !v.is_empty()))
        {
            continue;
        }
        let switch = matches!(arg.get_action(), clap::ArgAction::SetTrue);
        let text = match value {
            toml::Value::Boolean(b) if switch => {
                if *b {
                    flags.push(format!("--{long}").into());
                }
                used.push(key.clone());
                continue;
            }
            _ if switch => return Err(format!("{shown}: `{key}` is a switch: true or false")),
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Array(items) if arg.get_value_delimiter().is_some() => items
                .iter()
                .map(|v| match v {
                    toml::Value::String(s) => Ok(s.clone()),
                    toml::Value::Integer(i) => Ok(i.to_string()),
                    other => Err(format!(
                        "{shown}: `{key}`: a list of strings, not {}",
                        other.type_str()
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
                .join(","),
            other => {
                return Err(format!(
                    "{shown}: `{key}` takes one value, not {} {}",
                    if matches!(other, toml::Value::Array(_)) {
                        "an"
                    } else {
                        "a"
                    },
                    other.type_str()
                ))
            }
        };
        flags.push(format!("--{long}={text}").into());
        used.push(key.clone());
    }
    Ok((flags, used))
}

/// A parse error of a command line holding a file's settings, naming the
/// file and the setting (clap names the flag).
pub fn describe(path: &Path, e: &clap::Error) -> String {
    if e.kind() == clap::error::ErrorKind::MissingRequiredArgument {
        return format!(
            "{}: database_url is not set: put it in the file, pass --database-url or set STRATA_DATABASE_URL",
            path.display()
        );
    }
    let text = e.render().to_string();
    let first = text.lines().next().unwrap_or_default();
    let key = match e.get(clap::error::ContextKind::InvalidArg) {
        Some(clap::error::ContextValue::String(flag)) => flag
            .trim_start_matches("--")
            .split([' ', '='])
            .next()
            .map(|k| format!(" (the setting `{}`)", k.replace('-', "_"))),
        _ => None,
    };
    format!(
        "{}: {}{}",
        path.display(),
        first.trim_start_matches("error: "),
        key.unwrap_or_default()
    )
}

/// One effective setting of a checked file.
struct Setting {
    name: String,
    value: Option<String>,
    source: Source,
}

/// `strata config check FILE`: reads the file as `serve --config FILE`
/// would, with the environment's `STRATA_*` variables, and prints each
/// setting with its value and where it came from. Errors name the file and
/// the key.
pub fn check(path: &Path, json: bool) -> anyhow::Result<std::process::ExitCode> {
    let (flags, _) = file_flags(path, &[]).map_err(anyhow::Error::msg)?;
    let mut argv: Vec<OsString> = vec!["strata".into(), SERVE.into()];
    argv.extend(flags);
    let matches = crate::Cli::command()
        .try_get_matches_from(&argv)
        .map_err(|e| anyhow::anyhow!(describe(path, &e)))?;
    let serve = matches.subcommand_matches(SERVE).expect("parsed as serve");
    let cmd = crate::Cli::command();
    let mut settings = Vec::new();
    for arg in cmd
        .find_subcommand(SERVE)
        .expect("serve is a subcommand")
        .get_arguments()
    {
        let Some(long) = arg.get_long() else { continue };
        if ["config", "help", "version"].contains(&long) {
            continue;
        }
        let id = arg.get_id().as_str();
        let value = serve.get_raw(id).map(|vals| {
            vals.map(|v| v.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(",")
        });
        let name = long.replace('-', "_");
        let source = match serve.value_source(id) {
            Some(clap::parser::ValueSource::EnvVariable) => Source::Env,
            // Only the file's settings are on this command line.
            Some(clap::parser::ValueSource::CommandLine) => Source::File,
            _ => Source::Default,
        };
        let secret = name.contains("url");
        settings.push(Setting {
            name,
            value: value.map(|v| if secret { redact(&v) } else { v }),
            source,
        });
    }
    if json || crate::exit::json() {
        let obj: BTreeMap<_, _> = settings
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    serde_json::json!({"value": s.value, "source": s.source.as_str()}),
                )
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({"ok": true, "file": path.display().to_string(), "settings": obj})
        );
    } else {
        println!("{}: valid", path.display());
        for s in &settings {
            println!(
                "  {:<28} {:<8} {}",
                s.name,
                s.source.as_str(),
                s.value.as_deref().unwrap_or("(unset)")
            );
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// A connection string without its passwords, in either of libpq's forms:
/// a URL (the password of its user info, which may itself hold `@`, and
/// any `password`/`sslpassword` query parameter) or `key=value` pairs
/// (spaces around `=` and quoted values included). A key-value string that
/// does not parse is hidden whole.
fn redact(url: &str) -> String {
    let secret = |key: &str| key.to_ascii_lowercase().contains("password");
    if let Some((scheme, rest)) = url.split_once("://") {
        let (authority_and_path, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        // The user info ends at the last '@' (a password may hold one).
        let mut out = match authority_and_path.rsplit_once('@') {
            Some((creds, host)) => match creds.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                None => format!("{scheme}://{creds}@{host}"),
            },
            None => format!("{scheme}://{authority_and_path}"),
        };
        if let Some(q) = query {
            let params: Vec<String> = q
                .split('&')
                .map(|kv| match kv.split_once('=') {
                    Some((k, _)) if secret(k) => format!("{k}=***"),
                    _ => kv.to_string(),
                })
                .collect();
            out.push('?');
            out.push_str(&params.join("&"));
        }
        return out;
    }
    redact_pairs(url, &secret).unwrap_or_else(|| "***".into())
}

/// `key = value` pairs as libpq reads them, secret values replaced; `None`
/// when the string is not such pairs.
fn redact_pairs(s: &str, secret: &dyn Fn(&str) -> bool) -> Option<String> {
    let mut out: Vec<String> = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Some(out.join(" "));
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_whitespace() && *c != '=') {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') || key.is_empty() {
            return None;
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            value.push('\'');
            loop {
                match chars.next()? {
                    '\\' => {
                        value.push('\\');
                        value.push(chars.next()?);
                    }
                    '\'' => {
                        value.push('\'');
                        break;
                    }
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                value.push(c);
            }
        }
        out.push(if secret(&key) {
            format!("{key}=***")
        } else {
            format!("{key}={value}")
        });
    }
}

/// `strata config`: the files `serve --config` reads.
#[derive(Subcommand, Debug)]
pub(crate) enum ConfigCmd {
    /// Validate a configuration file as `serve --config FILE` reads it (with the STRATA_* variables set now), and print every setting with its value and where it came from (file, env, default); exits 2 on an unknown key or a bad value, naming both
    Check {
        /// The TOML file
        file: PathBuf,
        /// Print one JSON object: {"ok": true, "file": ..., "settings": {name: {"value": ..., "source": "file"|"env"|"default"}}}
        #[arg(long)]
        json: bool,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_printed() {
        assert_eq!(
            redact("postgres://ana:s3cret@db:5432/strata"),
            "postgres://ana:***@db:5432/strata"
        );
        assert_eq!(
            redact("host=db password=s3cret dbname=strata"),
            "host=db password=*** dbname=strata"
        );
        assert_eq!(redact("postgres://db/strata"), "postgres://db/strata");
        // Every spelling libpq takes.
        for (given, shown) in [
            (
                "postgres://ana:p@ss@db/strata",
                "postgres://ana:***@db/strata",
            ),
            (
                "postgres://ana@db/strata?password=s3cret&sslmode=require",
                "postgres://ana@db/strata?password=***&sslmode=require",
            ),
            (
                "postgres://db/strata?sslpassword=s3cret",
                "postgres://db/strata?sslpassword=***",
            ),
            (
                "host=db password = s3cret dbname=strata",
                "host=db password=*** dbname=strata",
            ),
            (
                "host=db password='s3 \\'cret' sslpassword=k",
                "host=db password=*** sslpassword=***",
            ),
            ("host=db password='unterminated", "***"),
        ] {
            let out = redact(given);
            assert_eq!(out, shown, "{given}");
            assert!(!out.contains("s3"), "{given}");
        }
    }

    #[test]
    fn flags_on_the_command_line_are_found_in_both_forms() {
        let args: Vec<OsString> = ["--roles", "placer", "--slot=x", "--", "--listen"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(flags_given(&args), vec!["roles", "slot"]);
    }
}
