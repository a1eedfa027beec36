// Command cert-manager runs cert-manager v1.19.1's three components, the controller, the webhook and the
// cainjector, from the packages of the published module github.com/cert-manager/cert-manager: the lab's
// build of what a cert-manager install runs (scripts/install-cert-manager.sh, docs/lab-and-tests.md).
//
// cert-manager's own commands (cmd/controller, cmd/webhook, cmd/cainjector) are separate Go modules that are
// not tagged, so the Go module proxy does not serve them; this file is the small part they add: flags, the
// wiring of the registered controllers, and signal handling. Everything that acts on the cluster is the
// module's own code. The module path sits under cert-manager's so that its internal packages (the webhook's
// configuration and admission chain, the controller's default list) can be imported, as its commands do.
//
// Usage: cert-manager controller|webhook|cainjector [flags]: the flags are those cert-manager's chart passes
// (deploy/charts/cert-manager, rendered with its default values), so the chart's Deployments run it
// unchanged; without --kubeconfig a component uses its Pod's ServiceAccount, as in a real install. A flag
// the chart may pass that this build does not implement is refused, never ignored.
package main

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	apiext "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/kubernetes"
	kscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"
	apireg "k8s.io/kube-aggregator/pkg/apis/apiregistration/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	ctrldefaults "github.com/cert-manager/cert-manager/internal/apis/config/controller/v1alpha1"
	"github.com/cert-manager/cert-manager/internal/apis/config/shared"
	webhookconfig "github.com/cert-manager/cert-manager/internal/apis/config/webhook"
	"github.com/cert-manager/cert-manager/internal/kube"
	"github.com/cert-manager/cert-manager/internal/webhook"
	cmscheme "github.com/cert-manager/cert-manager/pkg/client/clientset/versioned/scheme"
	"github.com/cert-manager/cert-manager/pkg/controller"
	"github.com/cert-manager/cert-manager/pkg/controller/cainjector"
	// the issuer types register themselves when imported, as in cert-manager's controller command
	_ "github.com/cert-manager/cert-manager/pkg/issuer/acme"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/ca"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/selfsigned"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/vault"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/venafi"
	logf "github.com/cert-manager/cert-manager/pkg/logs"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cert-manager controller|webhook|cainjector [flags]")
		os.Exit(2)
	}
	logf.InitLogs()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	switch os.Args[1] {
	case "controller":
		err = runController(ctx, os.Args[2:])
	case "webhook":
		err = runWebhook(ctx, os.Args[2:])
	case "cainjector":
		err = runCAInjector(ctx, os.Args[2:])
	default:
		err = fmt.Errorf("unknown component %q: give controller, webhook or cainjector", os.Args[1])
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "cert-manager %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

// list is a flag given once per value, as the chart gives --dynamic-serving-dns-names.
type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

// flags common to the three components; klog's -v sets the log level as in cert-manager's commands.
func newFlags(name string) (*flag.FlagSet, *string) {
	fs := flag.NewFlagSet(name, flag.ExitOnError)
	klog.InitFlags(fs)
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig to use (default: the Pod's ServiceAccount)")
	return fs, kubeconfig
}

// leading runs fn while holding the Lease name in namespace ns (cert-manager's leader election), or at once
// when ns is empty; losing the Lease ends the process, as cert-manager's commands do.
func leading(ctx context.Context, kubeconfig, ns, name string, fn func(context.Context)) error {
	if ns == "" {
		fn(ctx)
		return nil
	}
	cfg, err := kube.BuildClientConfig("", kubeconfig)
	if err != nil {
		return err
	}
	cl, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	id, err := os.Hostname()
	if err != nil {
		return err
	}
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: ns, Name: name},
		Client:     cl.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: id + "-external-" + name},
	}
	// RunOrDie returns when the context ends (a signal) or the Lease is lost
	leaderelection.RunOrDie(ctx, leaderelection.LeaderElectionConfig{
		Lock: lock, LeaseDuration: 60 * time.Second, RenewDeadline: 40 * time.Second, RetryPeriod: 15 * time.Second,
		ReleaseOnCancel: true,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: fn,
			OnStoppedLeading: func() {},
		},
	})
	if ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("leader election lost")
}

// exitOn ends the process on a component's error: it runs in the leader's goroutine, where nothing else
// would see it (cert-manager's commands exit the same way).
func exitOn(component string, err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "cert-manager %s: %v\n", component, err)
		os.Exit(1)
	}
}

func runController(ctx context.Context, args []string) error {
	fs, kubeconfig := newFlags("controller")
	crNamespace := fs.String("cluster-resource-namespace", "cert-manager",
		"namespace of the Secrets a ClusterIssuer refers to (the chart sets the release's namespace)")
	enabled := fs.String("controllers", strings.Join(ctrldefaults.DefaultEnabledControllers, ","),
		"comma-separated controllers to run (default: cert-manager's default set)")
	electionNS := fs.String("leader-election-namespace", "", "namespace of the leader Lease (none: no election)")
	solverImage := fs.String("acme-http01-solver-image", "quay.io/jetstack/cert-manager-acmesolver:v1.19.1",
		"image of the ACME HTTP-01 solver Pods")
	maxChallenges := fs.Int("max-concurrent-challenges", 60, "ACME challenges processed at once")
	healthz := fs.String("healthz-listen-address", "0.0.0.0:9403", "address of /livez (plain HTTP; 0: none)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	log := logf.Log.WithName("controller")
	ctx = logf.NewContext(ctx, log)
	opts := controller.ContextOptions{
		Kubeconfig:         *kubeconfig,
		KubernetesAPIQPS:   20,
		KubernetesAPIBurst: 50,
		IssuerOptions: controller.IssuerOptions{
			ClusterResourceNamespace:        *crNamespace,
			ClusterIssuerAmbientCredentials: true,
		},
		ACMEOptions: controller.ACMEOptions{
			HTTP01SolverImage:                 *solverImage,
			HTTP01SolverResourceRequestCPU:    resource.MustParse("10m"),
			HTTP01SolverResourceRequestMemory: resource.MustParse("64Mi"),
			HTTP01SolverResourceLimitsCPU:     resource.MustParse("100m"),
			HTTP01SolverResourceLimitsMemory:  resource.MustParse("64Mi"),
			ACMEHTTP01SolverRunAsNonRoot:      true,
			DNS01CheckAuthoritative:           true,
			DNS01CheckRetryPeriod:             10 * time.Second,
		},
		IngressShimOptions: controller.IngressShimOptions{
			DefaultIssuerKind:                 "Issuer",
			DefaultIssuerGroup:                "cert-manager.io",
			DefaultAutoCertificateAnnotations: []string{"kubernetes.io/tls-acme"},
		},
		CertificateOptions: controller.CertificateOptions{CopiedAnnotationPrefixes: []string{"*",
			"-kubectl.kubernetes.io/", "-fluxcd.io/", "-argocd.argoproj.io/"}},
		SchedulerOptions: controller.SchedulerOptions{MaxConcurrentChallenges: *maxChallenges},
	}
	if *healthz != "0" {
		// the chart's liveness probe: alive while the process serves
		mux := http.NewServeMux()
		mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
		go func() { log.Error(http.ListenAndServe(*healthz, mux), "healthz listener") }()
	}
	return leading(ctx, *kubeconfig, *electionNS, "cert-manager-controller", func(ctx context.Context) {
		exitOn("controller", runControllers(ctx, opts, *enabled))
	})
}

func runControllers(ctx context.Context, opts controller.ContextOptions, enabled string) error {
	log := logf.FromContext(ctx)
	factory, err := controller.NewContextFactory(ctx, opts)
	if err != nil {
		return fmt.Errorf("building the controller context: %w", err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for _, name := range strings.Split(enabled, ",") {
		construct, ok := controller.Known()[name]
		if !ok {
			return fmt.Errorf("--controllers: unknown controller %q", name)
		}
		iface, err := construct(factory)
		if err != nil {
			return fmt.Errorf("starting controller %s: %w", name, err)
		}
		wg.Add(1)
		go func(name string, c controller.Interface) {
			defer wg.Done()
			log.Info("starting controller", "controller", name)
			if err := c.Run(5, ctx); err != nil {
				errs <- fmt.Errorf("controller %s: %w", name, err)
			}
		}(name, iface)
	}
	// Every Context built by the factory shares its informer factories: starting them once serves all.
	built, err := factory.Build()
	if err != nil {
		return err
	}
	built.KubeSharedInformerFactory.Start(ctx.Done())
	built.SharedInformerFactory.Start(ctx.Done())
	built.HTTP01ResourceMetadataInformersFactory.Start(ctx.Done())
	if built.GatewaySolverEnabled {
		built.GWShared.Start(ctx.Done())
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case err := <-errs:
		return err
	case <-done:
		return nil
	}
}

func runWebhook(ctx context.Context, args []string) error {
	fs, kubeconfig := newFlags("webhook")
	port := fs.Int("secure-port", 10250, "port of the HTTPS admission endpoints")
	healthz := fs.Int("healthz-port", 6080, "port of /healthz (plain HTTP)")
	caNamespace := fs.String("dynamic-serving-ca-secret-namespace", "cert-manager", "namespace of the serving CA Secret")
	caName := fs.String("dynamic-serving-ca-secret-name", "cert-manager-webhook-ca", "the serving CA Secret")
	var dnsNames list
	fs.Var(&dnsNames, "dynamic-serving-dns-names", "a name of the serving certificate (once per name; required)")
	metrics := fs.String("metrics-listen-address", "0", "metrics address (only 0, none, in this build)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *metrics != "0" {
		return fmt.Errorf("--metrics-listen-address: this build serves no metrics; give 0")
	}
	if len(dnsNames) == 0 {
		return fmt.Errorf("--dynamic-serving-dns-names is required: the names the API server calls the webhook by")
	}
	log := logf.Log.WithName("webhook")
	ctx = logf.NewContext(ctx, log)
	cfg := webhookconfig.WebhookConfiguration{
		SecurePort:  int32(*port),
		HealthzPort: int32(*healthz),
		KubeConfig:  *kubeconfig,
		TLSConfig: shared.TLSConfig{Dynamic: shared.DynamicServingConfig{
			SecretNamespace: *caNamespace, SecretName: *caName,
			DNSNames: dnsNames, LeafDuration: 7 * 24 * time.Hour,
		}},
		MetricsListenAddress: "0",
	}
	srv, err := webhook.NewCertManagerWebhookServer(log, cfg)
	if err != nil {
		return fmt.Errorf("building the webhook server: %w", err)
	}
	return srv.Run(ctx)
}

func runCAInjector(ctx context.Context, args []string) error {
	fs, kubeconfig := newFlags("cainjector")
	electionNS := fs.String("leader-election-namespace", "", "namespace of the leader Lease (none: no election)")
	metrics := fs.String("metrics-listen-address", "0", "metrics address (only 0, none, in this build)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *metrics != "0" {
		return fmt.Errorf("--metrics-listen-address: this build serves no metrics; give 0")
	}
	log := logf.Log.WithName("cainjector")
	ctx = logf.NewContext(ctx, log)
	ctrl.SetLogger(log)
	restcfg, err := kube.BuildClientConfig("", *kubeconfig)
	if err != nil {
		return fmt.Errorf("--kubeconfig: %w", err)
	}
	scheme := runtime.NewScheme()
	utilruntime.Must(kscheme.AddToScheme(scheme))
	utilruntime.Must(cmscheme.AddToScheme(scheme))
	utilruntime.Must(apiext.AddToScheme(scheme))
	utilruntime.Must(apireg.AddToScheme(scheme))
	mgr, err := ctrl.NewManager(restcfg, ctrl.Options{
		Scheme:                  scheme,
		Metrics:                 metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress:  "0",
		LeaderElection:          *electionNS != "",
		LeaderElectionNamespace: *electionNS,
		LeaderElectionID:        "cert-manager-cainjector-leader-election",
	})
	if err != nil {
		return fmt.Errorf("building the manager: %w", err)
	}
	err = cainjector.RegisterAllInjectors(ctx, mgr, cainjector.SetupOptions{
		EnableCertificatesDataSource: true,
		// the four kinds the chart enables by default
		EnabledReconcilersFor: map[string]bool{
			"mutatingwebhookconfiguration": true, "validatingwebhookconfiguration": true,
			"apiservice": true, "customresourcedefinition": true,
		},
	})
	if err != nil {
		return fmt.Errorf("registering the injectors: %w", err)
	}
	return mgr.Start(ctx)
}
