// Command probe is the real node's test program (image localhost/dllm/probe): a static binary that
// serves HTTP, fetches a URL, or asks the API server who it is, using the pod's DNS and Service network.
//
//	probe serve ADDR           answer GET / with "probe <hostname>"
//	probe get URL [SECONDS]    fetch URL until it answers 200 or SECONDS pass; print the body
//	probe whoami [SECONDS]     POST a SelfSubjectReview with the pod's ServiceAccount token; print it
//	probe dial SECONDS ADDR... one TCP connect per HOST:PORT (16 at a time), each bounded by SECONDS;
//	                           print "ADDR open|refused|timeout|error ..." per line, in argument order
//	probe watch ADDR SECONDS   connect every 50 ms; print "open UNIX_NS" at the first success, then
//	                           "closed UNIX_NS REASON" at the first failure after it (exit 1 if none in time)
package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"
)

const saDir = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	if len(os.Args) < 2 {
		fail("usage: probe serve ADDR | get URL [SECONDS] | whoami [SECONDS] | dial SECONDS ADDR... | watch ADDR SECONDS")
	}
	http.DefaultClient.Timeout = 5 * time.Second
	switch os.Args[1] {
	case "serve":
		serve(arg(2, ":8080"))
	case "get":
		fmt.Print(retry(seconds(3), func() (*http.Response, error) { return http.Get(arg(2, "")) }))
	case "whoami":
		fmt.Print(whoami(seconds(2)))
	case "dial":
		limit, addrs := seconds(2), os.Args[3:]
		for i, result := range dialAll(addrs, limit) {
			fmt.Println(addrs[i], result)
		}
	case "watch":
		watch(arg(2, ""), seconds(3))
	default:
		fail("unknown command " + os.Args[1])
	}
}

func arg(i int, fallback string) string {
	if len(os.Args) > i {
		return os.Args[i]
	}
	return fallback
}

func seconds(i int) time.Duration {
	n, err := strconv.Atoi(arg(i, "60"))
	if err != nil {
		fail("SECONDS must be a number: " + err.Error())
	}
	return time.Duration(n) * time.Second
}

func fail(message string) {
	fmt.Fprintln(os.Stderr, "probe:", message)
	os.Exit(1)
}

func serve(addr string) {
	host, _ := os.Hostname()
	http.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "probe %s\n", host)
	})
	fmt.Fprintln(os.Stderr, "probe: serving on", addr)
	fail(http.ListenAndServe(addr, nil).Error())
}

// retry calls do until it answers 200 or the time is up, waiting 200 ms between tries.
func retry(limit time.Duration, do func() (*http.Response, error)) string {
	deadline := time.Now().Add(limit)
	for {
		response, err := do()
		if err == nil {
			body, readErr := io.ReadAll(response.Body)
			response.Body.Close()
			if readErr == nil && response.StatusCode/100 == 2 {
				return string(body)
			}
			err = fmt.Errorf("status %d: %s %v", response.StatusCode, body, readErr)
		}
		if time.Now().After(deadline) {
			fail(err.Error())
		}
		fmt.Fprintln(os.Stderr, "probe: retrying:", err)
		time.Sleep(200 * time.Millisecond)
	}
}

func whoami(limit time.Duration) string {
	token, err := os.ReadFile(saDir + "/token")
	if err != nil {
		fail(err.Error())
	}
	ca, err := os.ReadFile(saDir + "/ca.crt")
	if err != nil {
		fail(err.Error())
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	client := &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}},
	}
	url := "https://kubernetes.default.svc/apis/authentication.k8s.io/v1/selfsubjectreviews"
	body := []byte(`{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`)
	return retry(limit, func() (*http.Response, error) {
		request, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return nil, err
		}
		request.Header.Set("Authorization", "Bearer "+string(bytes.TrimSpace(token)))
		request.Header.Set("Content-Type", "application/json")
		return client.Do(request)
	})
}

// dial connects once and names the outcome: open, refused (a RST or an ICMP unreachable, as a REJECT
// rule sends), timeout (no answer: a DROP), or error with the message.
func dial(addr string, limit time.Duration) string {
	conn, err := net.DialTimeout("tcp", addr, limit)
	var netErr net.Error
	switch {
	case err == nil:
		conn.Close()
		return "open"
	case errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH):
		return "refused"
	case errors.As(err, &netErr) && netErr.Timeout():
		return "timeout"
	default:
		return "error " + err.Error()
	}
}

// dialAll dials every address, a bounded number at a time, so that many silent (dropped) ports cost
// one time limit each batch rather than one each.
func dialAll(addrs []string, limit time.Duration) []string {
	results := make([]string, len(addrs))
	slots := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for i, addr := range addrs {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer wg.Done()
			results[i] = dial(addr, limit)
			<-slots
		}()
	}
	wg.Wait()
	return results
}

// watch waits for addr to accept, then for the first connection that does not (a policy came into
// force), printing the wall-clock time of each; the caller compares them with its own clock.
func watch(addr string, limit time.Duration) {
	deadline, opened := time.Now().Add(limit), false
	for time.Now().Before(deadline) {
		result := dial(addr, time.Second)
		if !opened && result == "open" {
			opened = true
			fmt.Println("open", time.Now().UnixNano())
		} else if opened && result != "open" {
			fmt.Println("closed", time.Now().UnixNano(), result)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	fail("no change within the time limit")
}
