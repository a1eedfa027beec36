{{/* An image reference: (list $ <image values> <upstream image values>) -> the upstream spelling's repository in
     full when it is set (as upstream: no imageRegistry), else <imageRegistry>/<repository>; then @<digest> of the
     upstream spelling, else :<tag or appVersion> followed by @<digest> of our spelling when it is set (a released
     chart sets both: the tag says which release, the digest pins it). */}}
{{- define "tsc.image" -}}
{{- $root := index . 0 -}}{{- $img := index . 1 -}}{{- $up := index . 2 -}}
{{- $repo := coalesce $up.repository $up.repo -}}
{{- if not $repo }}{{ $repo = printf "%s/%s" ($root.Values.imageRegistry | trimSuffix "/") $img.repository }}{{ end -}}
{{- if $up.digest -}}
{{ $repo }}@{{ $up.digest }}
{{- else -}}
{{ $repo }}:{{ $up.tag | default $img.tag | default $root.Chart.AppVersion }}{{ with $img.digest }}@{{ . }}{{ end }}
{{- end -}}
{{- end -}}

{{/* Stop before anything is installed when a setting is wrong, naming the value and the fix. */}}
{{- define "tsc.validate" -}}
{{- if not (has .Values.provider (list "" "headscale" "tailscale" "static")) -}}
{{- fail (printf "provider=%q is not a provider; use headscale, tailscale or static" .Values.provider) -}}
{{- end -}}
{{- if and (eq .Values.provider "headscale") (not .Values.headscale.url) -}}
{{- fail "provider headscale needs headscale.url, the headscale server's URL: --set headscale.url=https://headscale.example.com" -}}
{{- end -}}
{{- $opImg := .Values.operatorConfig.image -}}{{- $pxImg := .Values.proxyConfig.image -}}
{{- /* not needed when both images are named in full with upstream's keys */ -}}
{{- if and (not .Values.imageRegistry) (not (and (coalesce $opImg.repository $opImg.repo) (coalesce $pxImg.repository $pxImg.repo))) -}}
{{- fail "imageRegistry is empty: set it to the registry you pushed both images to (make images REGISTRY=registry.example.com/tailscale TAG=<chart appVersion>), e.g. --set imageRegistry=registry.example.com/tailscale (or name both images in full: operatorConfig.image.repository and proxyConfig.image.repository)" -}}
{{- end -}}
{{- range $key, $img := dict "image" .Values.image "proxy.image" .Values.proxy.image -}}
{{- if and $img.digest (not (regexMatch "^sha256:[a-f0-9]{64}$" $img.digest)) -}}
{{- fail (printf "%s.digest=%q is not an image digest; use sha256:<64 hex digits> (the index digest the registry reports), or \"\" for the tag alone" $key $img.digest) -}}
{{- end -}}
{{- end -}}
{{- include "tsc.validateUpstream" . -}}
{{- if not (has .Values.ingressScheme (list "auto" "https" "http")) -}}
{{- fail (printf "ingressScheme=%q is not a scheme; use auto, https or http" .Values.ingressScheme) -}}
{{- end -}}
{{- if not (has .Values.proxy.firewallMode (list "" "auto" "iptables" "nftables")) -}}
{{- fail (printf "proxy.firewallMode=%q is not a firewall mode; use auto, iptables or nftables (or \"\")" .Values.proxy.firewallMode) -}}
{{- end -}}
{{- with .Values.dns.stubZoneConfigMap -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$" .) -}}
{{- fail (printf "dns.stubZoneConfigMap=%q is not <namespace>/<name> of a ConfigMap; use e.g. kube-system/coredns, or \"\" to add the stub zone yourself" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* imagePullSecrets ([{name: a}, {name: b}]) as PROXY_IMAGE_PULL_SECRETS wants them: "a,b". */}}
{{- define "tsc.pullSecretNames" -}}
{{- $names := list -}}
{{- range . }}{{ $names = append $names .name }}{{ end -}}
{{ join "," $names }}
{{- end -}}


{{/* The provider: provider, or "" = headscale when headscale.url is set, else tailscale (upstream's values). */}}
{{- define "tsc.provider" -}}
{{- .Values.provider | default (ternary "headscale" "tailscale" (not (empty .Values.headscale.url))) -}}
{{- end -}}

{{/* One setting spelt two ways: (list <upstream name> <upstream value> <our name> <our value> <our default>) ->
     {"v": the upstream value when set, else ours}; both set to different values stops the install. */}}
{{- define "tsc.either" -}}
{{- $uname := index . 0 }}{{ $u := index . 1 }}{{ $oname := index . 2 }}{{ $o := index . 3 }}{{ $def := index . 4 -}}
{{- if and (not (empty $u)) (not (eq (toJson $o) (toJson $def))) (not (eq (toJson $o) (toJson $u))) -}}
{{- fail (printf "%s and %s are the same setting and are set to different values (%s, %s): keep one" $uname $oname (toJson $u) (toJson $o)) -}}
{{- end -}}
{{- toJson (dict "v" (ternary $o $u (empty $u))) -}}
{{- end -}}

{{/* The API server proxy: (dict mode hostname tags) from apiServerProxy.*, or from upstream's
     apiServerProxyConfig.mode and operatorConfig.hostname/defaultTags (the in-process proxy is the operator's
     device upstream, so its name and tags are the operator's, tailscale-operator and tag:k8s-operator by default). */}}
{{- define "tsc.apiServerProxy" -}}
{{- $up := .Values.apiServerProxyConfig.mode | toString -}}
{{- $mode := .Values.apiServerProxy.mode | toString -}}
{{- if eq $mode "false" }}{{ $mode = "off" }}{{ end -}}
{{- $oc := .Values.operatorConfig -}}
{{- $hostname := .Values.apiServerProxy.hostname -}}{{- $tags := .Values.apiServerProxy.tags -}}
{{- if and $up (ne $up "<nil>") -}}
{{- if not (has $up (list "true" "false" "noauth")) -}}
{{- fail (printf "apiServerProxyConfig.mode=%q is not a mode; use \"true\" (auth), \"noauth\" or \"false\" (or apiServerProxy.mode: auth, noauth, off)" $up) -}}
{{- end -}}
{{- $m := get (dict "true" "auth" "false" "off" "noauth" "noauth") $up -}}
{{- if and (ne $mode "off") (ne $mode $m) -}}
{{- fail (printf "apiServerProxyConfig.mode=%q and apiServerProxy.mode=%q are the same setting with different values: keep one" $up $mode) -}}
{{- end -}}
{{- $mode = $m -}}
{{- $hostname = $oc.hostname | default "tailscale-operator" -}}
{{- $tags = $oc.defaultTags | default (list "tag:k8s-operator") -}}
{{- end -}}
{{- toJson (dict "mode" $mode "hostname" $hostname "tags" $tags) -}}
{{- end -}}

{{/* Upstream's values this chart cannot carry out: stop, naming the value and what to use instead. */}}
{{- define "tsc.validateUpstream" -}}
{{- $v := .Values -}}
{{- if $v.oauth.audience -}}
{{- fail "oauth.audience (workload identity federation) is not supported by this controller: give it an OAuth client instead, with oauth.clientId and oauth.clientSecret, or a Secret operator-oauth with keys client_id and client_secret" -}}
{{- end -}}
{{- if and (or $v.oauth.clientId $v.oauth.clientSecret) (not (and $v.oauth.clientId $v.oauth.clientSecret)) -}}
{{- fail "oauth.clientId and oauth.clientSecret go together: set both, or neither and create Secret operator-oauth (keys client_id, client_secret) yourself" -}}
{{- end -}}
{{- if and $v.oauth.clientId (or $v.credentials.oauthClientID $v.credentials.oauthClientSecret) -}}
{{- fail "oauth.clientId/clientSecret and credentials.oauthClientID/oauthClientSecret are the same setting: keep one" -}}
{{- end -}}
{{- if and $v.oauth.clientId (ne (include "tsc.provider" .) "tailscale") -}}
{{- fail (printf "oauth.clientId is a Tailscale OAuth client, but the provider is %s: remove oauth.*, or set provider=tailscale" (include "tsc.provider" .)) -}}
{{- end -}}
{{- $repo := (coalesce $v.operatorConfig.image.repository $v.operatorConfig.image.repo) | default "" -}}
{{- if regexMatch "(^|/)tailscale/k8s-operator$" $repo -}}
{{- fail (printf "operatorConfig.image.repository=%q is upstream's operator, not this controller: push this controller's image (make images REGISTRY=...) and set imageRegistry (or operatorConfig.image.repository to <registry>/containerboot-py-controller)" $repo) -}}
{{- end -}}
{{- $log := $v.operatorConfig.logging | default $v.logging -}}
{{- if not (has $log (list "info" "debug" "dev")) -}}
{{- fail (printf "operatorConfig.logging=%q is not a log level; use info, debug or dev" $log) -}}
{{- end -}}
{{- if and $v.operatorConfig.logging (ne $v.logging "info") (ne $v.logging $v.operatorConfig.logging) -}}
{{- fail "logging and operatorConfig.logging are the same setting and are set to different values: keep one" -}}
{{- end -}}
{{- $imp := $v.apiServerProxyConfig.allowImpersonation | toString -}}
{{- if not (has $imp (list "" "<nil>" "true" "false")) -}}
{{- fail (printf "apiServerProxyConfig.allowImpersonation=%q; use \"true\" or \"false\"" $imp) -}}
{{- end -}}
{{- if and (eq $imp "true") (ne (get (include "tsc.apiServerProxy" . | fromJson) "mode") "auth") -}}
{{- fail "apiServerProxyConfig.allowImpersonation=\"true\" is for ProxyGroups of type kube-apiserver, which this controller does not build (they serve through Tailscale Services): run the API server proxy in auth mode instead, apiServerProxyConfig.mode=\"true\" (docs/apiserver-proxy.md), and remove allowImpersonation" -}}
{{- end -}}
{{- range (concat $v.extraEnv $v.operatorConfig.extraEnv) -}}
{{- if and (eq (.name | default "") "TS_EXPERIMENTAL_KUBE_API_EVENTS") (eq (toString .value) "true") -}}
{{- fail "operatorConfig.extraEnv TS_EXPERIMENTAL_KUBE_API_EVENTS has been removed upstream and does nothing here: remove it (API server proxy events follow the tailnet policy's grants)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
