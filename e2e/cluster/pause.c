/* The real node's sandbox process: it holds a pod's namespaces open and does nothing else.
 * As PID 1 of the pod it also reaps any orphan that ends up as its child.
 * Build: gcc -static -Os -s -o pause pause.c (e2e/cluster/build.sh). */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stopping;

static void on_stop(int signo) { stopping = signo; }

static void on_child(int signo) {
  (void)signo;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("dllm-pause 1");
    return 0;
  }
  struct sigaction stop = {0}, child = {0};
  stop.sa_handler = on_stop;
  child.sa_handler = on_child;
  child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  if (sigaction(SIGINT, &stop, NULL) || sigaction(SIGTERM, &stop, NULL) ||
      sigaction(SIGCHLD, &child, NULL)) {
    perror("dllm-pause: sigaction");
    return 1;
  }
  if (getpid() != 1) fputs("dllm-pause: not PID 1; running anyway\n", stderr);
  while (!stopping) pause();
  return 0;
}
