//! `tether rollout agents`: a new agent image on every node, with the new agent
//! connected before the old one drains, where the DaemonSet itself cannot surge
//! (Kubernetes before 1.22). A surge DaemonSet beside the old one, then the old one made
//! again from it; every step resumes where an interrupted run left off.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::api::{DeleteParams, PostParams};
use kube::Api;

use super::duration;

/// The label that keeps the surge DaemonSet's pods apart from the original's.
const SET_LABEL: &str = "tether.dev/agent-set";
/// On the surge DaemonSet: the DaemonSet it stands in for.
const SURGE_FOR: &str = "tether.dev/surge-for";

/// What the DaemonSets are made with: their fields' manager is `tether`.
fn create_params() -> PostParams {
    PostParams {
        field_manager: Some("tether".into()),
        ..Default::default()
    }
}

/// What to roll out.
#[derive(clap::Subcommand, Debug)]
pub enum RolloutCommand {
    /// Move the agent DaemonSet to a new image with no gap on any node.
    ///
    /// For clusters whose DaemonSets cannot surge (before 1.22; from 1.22 the shipped
    /// `maxSurge: 1` does this by itself). Makes `<daemonset>-surge`, a copy with the
    /// new image, waits until its agent is ready on every node, deletes the original
    /// (its agents drain: new dials go to the new ones, their open tunnels run to
    /// --drain-timeout), makes the original again with the new image, waits for it,
    /// and deletes the copy the same way. The DaemonSet ends as it began, name,
    /// selector and annotations, with the new image. Run it again after an
    /// interruption: it resumes. Tether only.
    Agents(AgentsArgs),
}

/// `tether rollout agents` flags.
#[derive(clap::Args, Debug)]
pub struct AgentsArgs {
    /// The new image for the agent container.
    #[arg(long)]
    pub image: String,
    /// The agent DaemonSet.
    #[arg(long, default_value = "konnectivity-agent")]
    pub daemonset: String,
    /// Its namespace.
    #[arg(long, short = 'n', default_value = "kube-system")]
    pub namespace: String,
    /// The container to change; needed only when the pod has several.
    #[arg(long)]
    pub container: Option<String>,
    /// The kubeconfig to use; in-cluster configuration when empty.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Give up (leaving every agent that runs running) after this long.
    #[arg(long, default_value = "10m", value_parser = duration)]
    pub timeout: Duration,
}

/// Runs the subcommand.
pub fn main(command: RolloutCommand) -> anyhow::Result<()> {
    let RolloutCommand::Agents(args) = command;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?
        .block_on(agents(&args))
}

/// Where a rollout stands, read from the two DaemonSets.
#[derive(Debug, PartialEq)]
enum Step {
    /// The original already runs the image and no copy is left.
    Done,
    /// Make the copy with the new image.
    MakeSurge,
    /// Wait for the copy, then delete the original.
    ReplaceOriginal,
    /// The original is being deleted: wait for it to go.
    AwaitOriginalGone,
    /// Make the original again from the copy.
    MakeOriginal,
    /// Wait for the original, then delete the copy.
    RetireSurge,
}

/// The next step, or why none can be taken.
fn step(
    original: Option<&DaemonSet>,
    surge: Option<&DaemonSet>,
    args: &AgentsArgs,
) -> anyhow::Result<Step> {
    let deleting = |d: &DaemonSet| d.metadata.deletion_timestamp.is_some();
    let has_image = |d: &DaemonSet| image(d, args.container.as_deref()).ok() == Some(&args.image);
    Ok(match (original, surge) {
        (None, None) => bail!(
            "no daemonset/{} in namespace {}: give the agent DaemonSet with --daemonset and --namespace",
            args.daemonset,
            args.namespace
        ),
        (Some(o), None) if has_image(o) && !deleting(o) => Step::Done,
        (Some(o), None) if !deleting(o) => Step::MakeSurge,
        (Some(_), None) => bail!(
            "daemonset/{} is being deleted and there is no {}-surge to take over: wait for it to go and apply it again",
            args.daemonset,
            args.daemonset
        ),
        (_, Some(s)) if !has_image(s) => bail!(
            "daemonset/{}-surge runs {}: a rollout to that image was interrupted; run again with --image {} to finish it",
            args.daemonset,
            image(s, args.container.as_deref()).unwrap_or("another image"),
            image(s, args.container.as_deref()).unwrap_or("that image"),
        ),
        (_, Some(s)) if deleting(s) => bail!(
            "daemonset/{}-surge is being deleted: wait for it to go and run again",
            args.daemonset
        ),
        (Some(o), Some(_)) if deleting(o) => Step::AwaitOriginalGone,
        (Some(o), Some(_)) if has_image(o) => Step::RetireSurge,
        (Some(_), Some(_)) => Step::ReplaceOriginal,
        (None, Some(_)) => Step::MakeOriginal,
    })
}

/// The rollout, from wherever it stands to its end.
async fn agents(args: &AgentsArgs) -> anyhow::Result<()> {
    let client = tether_ops::kubeclient::client(args.kubeconfig.as_deref()).await?;
    let api: Api<DaemonSet> = Api::namespaced(client, &args.namespace);
    let surge_name = format!("{}-surge", args.daemonset);
    let deadline = Instant::now() + args.timeout;
    loop {
        let original = api.get_opt(&args.daemonset).await?;
        let surge = api.get_opt(&surge_name).await?;
        let next = step(original.as_ref(), surge.as_ref(), args)?;
        match next {
            Step::Done => {
                ready(&api, &args.daemonset, deadline).await?;
                println!(
                    "daemonset/{} runs {} on every node",
                    args.daemonset, args.image
                );
                return Ok(());
            }
            Step::MakeSurge => {
                let o = original.expect("the step has it");
                api.create(&create_params(), &surge_of(&o, &surge_name, args)?)
                    .await
                    .with_context(|| format!("cannot create daemonset/{surge_name}"))?;
                println!("daemonset/{surge_name} created with {}", args.image);
            }
            Step::ReplaceOriginal => {
                ready(&api, &surge_name, deadline).await?;
                retire(&api, &args.daemonset, deadline).await?;
            }
            Step::AwaitOriginalGone => gone(&api, &args.daemonset, deadline).await?,
            Step::MakeOriginal => {
                let s = surge.expect("the step has it");
                api.create(&create_params(), &original_of(&s, &args.daemonset))
                    .await
                    .with_context(|| format!("cannot create daemonset/{}", args.daemonset))?;
                println!(
                    "daemonset/{} created again with {}",
                    args.daemonset, args.image
                );
            }
            Step::RetireSurge => {
                ready(&api, &args.daemonset, deadline).await?;
                retire(&api, &surge_name, deadline).await?;
            }
        }
    }
}

/// The image of the agent container (`container`, or the pod's only one).
fn image<'a>(d: &'a DaemonSet, container: Option<&str>) -> anyhow::Result<&'a str> {
    let containers = d
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|p| p.containers.as_slice())
        .unwrap_or_default();
    let found = match container {
        Some(name) => containers.iter().find(|c| c.name == name),
        None if containers.len() == 1 => containers.first(),
        None => bail!(
            "the pod has {} containers ({}): name the agent's with --container",
            containers.len(),
            containers
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    found
        .and_then(|c| c.image.as_deref())
        .with_context(|| format!("no container {} with an image", container.unwrap_or("")))
}

/// The copy: the original's spec with the new image, and a label of its own on its
/// selector and pods, so that neither DaemonSet counts the other's pods.
fn surge_of(original: &DaemonSet, name: &str, args: &AgentsArgs) -> anyhow::Result<DaemonSet> {
    image(original, args.container.as_deref())?;
    let mut spec = original.spec.clone().context("the DaemonSet has no spec")?;
    let labels = spec.selector.match_labels.get_or_insert_with(BTreeMap::new);
    labels.insert(SET_LABEL.into(), "surge".into());
    let template_labels = spec
        .template
        .metadata
        .get_or_insert_with(Default::default)
        .labels
        .get_or_insert_with(BTreeMap::new);
    template_labels.insert(SET_LABEL.into(), "surge".into());
    let pod = spec
        .template
        .spec
        .as_mut()
        .context("the DaemonSet has no pod")?;
    let only = pod.containers.len() == 1;
    for c in &mut pod.containers {
        if only || Some(c.name.as_str()) == args.container.as_deref() {
            c.image = Some(args.image.clone());
        }
    }
    let mut annotations = original.metadata.annotations.clone().unwrap_or_default();
    annotations.insert(SURGE_FOR.into(), args.daemonset.clone());
    Ok(DaemonSet {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            namespace: original.metadata.namespace.clone(),
            labels: original.metadata.labels.clone(),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// The original again: the copy's spec (the new image) without the copy's label, under
/// the original's name and annotations.
fn original_of(surge: &DaemonSet, name: &str) -> DaemonSet {
    let mut spec = surge.spec.clone().unwrap_or_default();
    if let Some(l) = spec.selector.match_labels.as_mut() {
        l.remove(SET_LABEL);
    }
    if let Some(l) = spec
        .template
        .metadata
        .as_mut()
        .and_then(|m| m.labels.as_mut())
    {
        l.remove(SET_LABEL);
    }
    let mut annotations = surge.metadata.annotations.clone().unwrap_or_default();
    annotations.remove(SURGE_FOR);
    DaemonSet {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            namespace: surge.metadata.namespace.clone(),
            labels: surge.metadata.labels.clone(),
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

/// How many of a DaemonSet's pods are up to date and ready, of how many it should run;
/// `None` until its controller has seen the current spec.
fn readiness(d: &DaemonSet) -> Option<(i32, i32)> {
    let status = d.status.as_ref()?;
    let generation = d.metadata.generation.unwrap_or(0);
    if status.observed_generation.unwrap_or(0) < generation {
        return None;
    }
    let desired = status.desired_number_scheduled;
    let up = status
        .updated_number_scheduled
        .unwrap_or(0)
        .min(status.number_ready)
        .min(status.number_available.unwrap_or(0));
    Some((up, desired))
}

/// Waits until every node runs a ready pod of `name`.
async fn ready(api: &Api<DaemonSet>, name: &str, deadline: Instant) -> anyhow::Result<()> {
    let mut said = None;
    loop {
        let d = api.get(name).await?;
        let now = readiness(&d);
        if now != said {
            if let Some((up, desired)) = now {
                println!("daemonset/{name}: {up} of {desired} agents ready");
            }
            said = now;
        }
        if matches!(now, Some((up, desired)) if up >= desired) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "daemonset/{name}: not every agent ready before --timeout; nothing was deleted and the agents that run serve on. Run again to resume, or delete daemonset/{name} to abandon"
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Deletes `name` and waits until it and its pods are gone: its agents drain, and their
/// tunnels run on until --drain-timeout ends them.
async fn retire(api: &Api<DaemonSet>, name: &str, deadline: Instant) -> anyhow::Result<()> {
    // Foreground: the DaemonSet stays until its pods are gone, so its name is free
    // only once no old agent is left.
    if let Err(e) = api.delete(name, &DeleteParams::foreground()).await {
        if !matches!(&e, kube::Error::Api(s) if s.code == 404) {
            return Err(e).with_context(|| format!("cannot delete daemonset/{name}"));
        }
    }
    println!("daemonset/{name} deleted; its agents drain");
    gone(api, name, deadline).await
}

/// Waits until `name` is gone.
async fn gone(api: &Api<DaemonSet>, name: &str, deadline: Instant) -> anyhow::Result<()> {
    while api.get_opt(name).await?.is_some() {
        if Instant::now() > deadline {
            bail!(
                "daemonset/{name} still there at --timeout (its pods drain); run again to resume"
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    println!("daemonset/{name} gone");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::DaemonSetSpec;
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    fn args() -> AgentsArgs {
        AgentsArgs {
            image: "tether:b".into(),
            daemonset: "konnectivity-agent".into(),
            namespace: "kube-system".into(),
            container: None,
            kubeconfig: None,
            timeout: Duration::from_secs(1),
        }
    }

    fn daemonset(name: &str, image: &str) -> DaemonSet {
        let labels: BTreeMap<String, String> =
            [("k8s-app".to_string(), "konnectivity-agent".to_string())].into();
        DaemonSet {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("kube-system".into()),
                labels: Some(labels.clone()),
                annotations: Some(
                    [(
                        "kubectl.kubernetes.io/last-applied-configuration".to_string(),
                        "{}".to_string(),
                    )]
                    .into(),
                ),
                uid: Some("u".into()),
                resource_version: Some("1".into()),
                ..Default::default()
            },
            spec: Some(DaemonSetSpec {
                selector: LabelSelector {
                    match_labels: Some(labels.clone()),
                    ..Default::default()
                },
                template: PodTemplateSpec {
                    metadata: Some(kube::api::ObjectMeta {
                        labels: Some(labels),
                        ..Default::default()
                    }),
                    spec: Some(PodSpec {
                        containers: vec![Container {
                            name: "konnectivity-agent".into(),
                            image: Some(image.into()),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }),
                },
                ..Default::default()
            }),
            status: None,
        }
    }

    #[test]
    fn the_copy_has_a_selector_of_its_own_and_the_original_comes_back_as_it_was() {
        let original = daemonset("konnectivity-agent", "tether:a");
        let surge = surge_of(&original, "konnectivity-agent-surge", &args()).unwrap();
        assert_eq!(image(&surge, None).unwrap(), "tether:b");
        let spec = surge.spec.as_ref().unwrap();
        assert_eq!(
            spec.selector.match_labels.as_ref().unwrap()[SET_LABEL],
            "surge"
        );
        let pod_labels = spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .as_ref()
            .unwrap();
        assert_eq!(pod_labels[SET_LABEL], "surge");
        assert_eq!(pod_labels["k8s-app"], "konnectivity-agent");
        assert!(surge.metadata.uid.is_none() && surge.metadata.resource_version.is_none());

        let again = original_of(&surge, "konnectivity-agent");
        assert_eq!(image(&again, None).unwrap(), "tether:b");
        let mut expected = original.clone();
        expected.metadata.uid = None;
        expected.metadata.resource_version = None;
        let spec = expected.spec.as_mut().unwrap();
        spec.template.spec.as_mut().unwrap().containers[0].image = Some("tether:b".into());
        assert_eq!(again, expected);
    }

    #[test]
    fn each_state_has_its_step() {
        let a = args();
        let old = daemonset("konnectivity-agent", "tether:a");
        let new = daemonset("konnectivity-agent", "tether:b");
        let surge = surge_of(&old, "konnectivity-agent-surge", &a).unwrap();
        let mut going = old.clone();
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(step(Some(&old), None, &a).unwrap(), Step::MakeSurge);
        assert_eq!(
            step(Some(&old), Some(&surge), &a).unwrap(),
            Step::ReplaceOriginal
        );
        assert_eq!(
            step(Some(&going), Some(&surge), &a).unwrap(),
            Step::AwaitOriginalGone
        );
        assert_eq!(step(None, Some(&surge), &a).unwrap(), Step::MakeOriginal);
        assert_eq!(
            step(Some(&new), Some(&surge), &a).unwrap(),
            Step::RetireSurge
        );
        assert_eq!(step(Some(&new), None, &a).unwrap(), Step::Done);
        let other = AgentsArgs {
            image: "tether:c".into(),
            ..args()
        };
        let e = step(Some(&old), Some(&surge), &other)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--image tether:b"), "{e}");
        assert!(step(None, None, &a)
            .unwrap_err()
            .to_string()
            .contains("--daemonset"));
    }

    #[test]
    fn readiness_waits_for_the_controller_and_every_node() {
        use k8s_openapi::api::apps::v1::DaemonSetStatus;
        let mut d = daemonset("konnectivity-agent-surge", "tether:b");
        d.metadata.generation = Some(1);
        assert_eq!(readiness(&d), None);
        d.status = Some(DaemonSetStatus {
            observed_generation: Some(1),
            desired_number_scheduled: 3,
            updated_number_scheduled: Some(3),
            number_ready: 2,
            number_available: Some(2),
            ..Default::default()
        });
        assert_eq!(readiness(&d), Some((2, 3)));
    }
}
